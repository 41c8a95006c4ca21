"""Small synthetic dump sets (format v1) written with the numpy reference, for the conformance tests;
optionally with the float64 truth of every result (tests/conformance/truth_layer.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.dump_writer import DumpSetWriter, TruthBlock
from kda_spec.storage import open_writer
from tests.conformance.numpy_adapter import NumpyAdapter, l2norm
from tests.conformance.truth_layer import layer_truth

TRUTH_IMPLEMENTATION = "tests.conformance.truth_layer: the layer in float64 numpy"
TINY = KDAConfig(hidden_size=32, num_heads=2, head_dim=8, conv_size=4, rms_norm_eps=1e-5, preset="tiny")


def tiny_weights(config: KDAConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in fmt.weight_shapes(config.to_manifest()).items():
        if name.endswith("conv1d.weight"):
            weights[name] = rng.normal(0, 0.5, shape)
        elif name == "A_log":
            weights[name] = np.log(rng.uniform(1, 4, shape))
        elif name == "dt_bias":
            weights[name] = rng.normal(-2, 0.5, shape)
        elif name == "o_norm.weight":
            weights[name] = 1 + rng.normal(0, 0.1, shape)
        else:
            weights[name] = rng.normal(0, shape[-1] ** -0.5, shape)
    return {name: np.asarray(w, np.float32) for name, w in weights.items()}


def case_arrays(
    spec: fmt.CaseSpec,
    config: KDAConfig,
    weights: dict[str, np.ndarray],
    rng: np.random.Generator,
    dtypes: tuple[str, ...],
    intermediates: bool,
    truth: bool = False,
    hidden_std: float = 1.0,
) -> dict[str, np.ndarray]:
    tokens, num_seqs = spec.total_tokens, len(spec.seq_lens)
    x = rng.normal(0, hidden_std, (tokens, config.hidden_size)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(spec.seq_lens)]).astype(np.int32)
    arrays = {"hidden_states": x, "cu_seqlens": cu}
    init = None
    if spec.initial_state:
        shape = (num_seqs, config.num_heads, config.head_dim, config.head_dim)
        init = arrays["initial_recurrent_state"] = rng.normal(0, 0.1, shape).astype(np.float32)
    for dtype in dtypes:
        adapter = NumpyAdapter(config, weights, dtype)
        result = adapter.layer_extend(x, cu, init)
        arrays[fmt.result_key("out", dtype)] = fmt.stored_result(result.out, "out", dtype)
        inter = result.intermediates
        kernel_inputs = (
            l2norm(inter["q_after_conv"]),
            l2norm(inter["k_after_conv"]),
            inter["v_after_conv"],
            inter["g"],
            inter["beta"],
            cu,
            init,
        )
        for path in ("chunk", "fused_recurrent"):
            o, state = adapter.chunk_kernel(*kernel_inputs)
            arrays[fmt.result_key(f"o_kda_{path}", dtype)] = fmt.stored_result(o, f"o_kda_{path}", dtype)
            arrays[fmt.result_key(f"recurrent_state_{path}", dtype)] = state
        if intermediates:
            for name in fmt.INTERMEDIATE_KEYS:
                arrays[fmt.result_key(name, dtype)] = fmt.stored_result(inter[name], name, dtype)
        if truth:
            for name, value in layer_truth(config, weights, dtype, x, cu, init).items():
                arrays[fmt.truth_key(name, dtype)] = value
    return arrays


def write_dump_set(
    root: Path,
    cases: tuple[str | fmt.CaseSpec, ...],
    *,
    config: KDAConfig = TINY,
    seed: int = 0,
    dtypes: tuple[str, ...] = fmt.DTYPES,
    intermediates: bool = True,
    truth: bool = False,
    hidden_std: float = 1.0,
) -> Path:
    """Write a v1 dump set of `cases` (standard case ids, or specs of cases of one's own) under `root`,
    computed by the numpy reference, the hidden states normal with `hidden_std`; with `truth`, the float64
    truth of the output, final states and intermediates of every run too."""
    root = Path(root)
    weights = tiny_weights(config, seed)
    rng = np.random.default_rng(seed)
    with open_writer(str(root), overwrite=True) as writer:
        dump_set = DumpSetWriter(writer)
        dump_set.write_weights(weights, "synthetic")
        for spec in _specs(cases):
            arrays = case_arrays(spec, config, weights, rng, dtypes, intermediates, truth, hidden_std)
            dump_set.write_case(spec, arrays, sorted_keys=True)
        dump_set.commit(
            config=config,
            reference={"name": "numpy-reference", "versions": {"numpy": np.__version__}, "device": "cpu"},
            seed=seed,
            generator="tests.conformance.synthetic",
            truth=TruthBlock(TRUTH_IMPLEMENTATION, fmt.TRUTH_NAMES) if truth else None,
            created="2026-11-30T00:00:00Z",
        )
    return root


def _specs(cases: tuple[str | fmt.CaseSpec, ...]) -> list[fmt.CaseSpec]:
    """The specs of `cases` in order: a spec itself, an id (or group name) as `fmt.select_cases` has it."""
    specs: list[fmt.CaseSpec] = []
    for case in cases:
        specs.extend([case] if isinstance(case, fmt.CaseSpec) else fmt.select_cases([case]))
    return specs
