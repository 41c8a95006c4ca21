"""The float64 truth of a dump (kda_spec.truth): float64-accurate, the reference's math, stored and read."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from conformance.dumps.reader import DumpError, DumpSet
from dump_gen.cli import main
from dump_gen.inputs import case_inputs
from dump_gen.references.transformers_layer import TransformersReference
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig, get_preset
from kda_spec.dump_format import CASES_BY_ID
from kda_spec.storage import npz_bytes
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.truth import (
    IMPLEMENTATION,
    bf16_rounded,
    delta_rule,
    l2_normalised,
    layer_truth,
    run_weights,
    sigmoid,
    softplus,
)
from tests.dump_gen.conftest import CASES, TINY
from tests.dump_gen.validate import read_manifest, read_npz

pytestmark = pytest.mark.torch

TINY_CONFIG = get_preset("mini").replace(hidden_size=32, head_dim=16, preset="custom")
FLOAT64_BOUND = 1e-14  # relative (max abs error / max abs value): float64 rounding, far below float32's
EXTENDED = np.finfo(np.longdouble).eps < 1e-18
needs_extended = pytest.mark.skipif(not EXTENDED, reason="np.longdouble is no wider than float64 here")


def relative_error(value: np.ndarray, exact: np.ndarray) -> float:
    return float(np.max(np.abs(value - exact)) / np.max(np.abs(exact)))


def recurrence_longdouble(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule element by element in np.longdouble, written out apart from kda_spec.truth."""
    tokens, heads, dim = q.shape
    ld = np.longdouble
    scale = ld(1) / np.sqrt(ld(dim))
    s = state.astype(ld)
    o = np.zeros((tokens, heads, dim), ld)
    for t in range(tokens):
        for h in range(heads):
            for a in range(dim):
                s[h, a, :] *= np.exp(ld(g[t, h, a]))
            for b in range(dim):
                predicted = sum(ld(k[t, h, a]) * s[h, a, b] for a in range(dim))
                delta = ld(beta[t, h]) * (ld(v[t, h, b]) - predicted)
                for a in range(dim):
                    s[h, a, b] += ld(k[t, h, a]) * delta
            for b in range(dim):
                o[t, h, b] = sum(scale * ld(q[t, h, a]) * s[h, a, b] for a in range(dim))
    return o, s


def recurrence_inputs(rng: np.random.Generator, tokens: int = 12, heads: int = 2, dim: int = 4) -> list:
    """float64 q, k (L2-normalised), v, g (decays from 0.99 to 0.05), beta and an initial state."""
    q, k = (l2_normalised(rng.standard_normal((tokens, heads, dim))) for _ in range(2))
    v = rng.standard_normal((tokens, heads, dim))
    g = np.log(rng.uniform(0.05, 0.99, (tokens, heads, dim)))
    beta = rng.uniform(0.0, 1.0, (tokens, heads))
    state = 0.25 * rng.standard_normal((heads, dim, dim))
    return [q, k, v, g, beta, state]


@needs_extended
def test_recurrence_is_float64_accurate() -> None:
    """Against an np.longdouble recurrence: float64 to ~1e-15, where the same code in float32 is ~1e-7."""
    inputs = recurrence_inputs(np.random.default_rng(0))
    exact_o, exact_state = recurrence_longdouble(*inputs)
    o, state = delta_rule(*inputs)
    assert o.dtype == state.dtype == np.float64
    assert relative_error(o, exact_o) < FLOAT64_BOUND
    assert relative_error(state, exact_state) < FLOAT64_BOUND
    o32, state32 = delta_rule(*(x.astype(np.float32) for x in inputs))
    assert o32.dtype == np.float32
    assert relative_error(o32.astype(np.longdouble), exact_o) > 100 * FLOAT64_BOUND
    assert relative_error(state32.astype(np.longdouble), exact_state) > 100 * FLOAT64_BOUND


def layer_longdouble(
    weights: dict[str, np.ndarray],
    hidden: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
    config: KDAConfig,
) -> dict[str, np.ndarray]:
    """The layer in np.longdouble, written out apart from kda_spec.truth (loops for the conv)."""
    ld = np.longdouble
    w = {name: array.astype(ld) for name, array in weights.items()}
    x = hidden.astype(ld)
    tokens, heads, dim, width = x.shape[0], config.num_heads, config.head_dim, config.conv_size
    spans = list(itertools.pairwise(cu_seqlens.tolist()))

    def conv_silu(u: np.ndarray, weight: np.ndarray) -> np.ndarray:
        y = np.zeros_like(u)
        for start, end in spans:
            for t in range(start, end):
                for j in range(width):
                    if t - (width - 1) + j >= start:
                        y[t] += weight[:, 0, j] * u[t - (width - 1) + j]
        return (y / (1 + np.exp(-y))).reshape(tokens, heads, dim)

    def unit(a: np.ndarray) -> np.ndarray:
        return a / np.sqrt((a * a).sum(-1, keepdims=True) + ld(1e-6))

    q, k, v = (conv_silu(x @ w[f"{n}_proj.weight"].T, w[f"{n}_conv1d.weight"]) for n in "qkv")
    g_raw = ((x @ w["f_a_proj.weight"].T) @ w["f_b_proj.weight"].T).reshape(tokens, heads, dim)
    f = g_raw + w["dt_bias"].reshape(heads, dim)
    g = -np.exp(w["A_log"].reshape(heads, 1)) * np.where(f > 20, f, np.log1p(np.exp(f)))
    beta = 1 / (1 + np.exp(-(x @ w["b_proj.weight"].T)))
    g_out = ((x @ w["g_a_proj.weight"].T) @ w["g_b_proj.weight"].T).reshape(tokens, heads, dim)
    o = np.zeros((tokens, heads, dim), ld)
    states = []
    for index, (start, end) in enumerate(spans):
        state = np.zeros((heads, dim, dim)) if initial_state is None else initial_state[index]
        o[start:end], final = recurrence_longdouble(
            unit(q[start:end]), unit(k[start:end]), v[start:end], g[start:end], beta[start:end], state
        )
        states.append(final)
    rms = np.sqrt((o * o).mean(-1, keepdims=True) + ld(config.rms_norm_eps))
    o_norm = o / rms * w["o_norm.weight"] / (1 + np.exp(-g_out))
    out = o_norm.reshape(tokens, heads * dim) @ w["o_proj.weight"].T
    return {
        "out": out,
        "recurrent_state": np.stack(states),
        "q_after_conv": q,
        "k_after_conv": k,
        "v_after_conv": v,
        "g": g,
        "g_raw": g_raw,
        "beta": beta,
        "g_out": g_out,
        "o_norm": o_norm,
    }


@needs_extended
def test_layer_is_float64_accurate() -> None:
    """The whole layer against an np.longdouble one on float32 inputs (as a dump gives them): every
    result float64 and within ~1e-15, where the same code run in float32 misses by ~1e-7."""
    weights = synthetic_weights(TINY_CONFIG, seed=0)
    inputs = case_inputs(CASES_BY_ID["varlen_initstate"], TINY_CONFIG, seed=0)
    args = (weights, inputs.hidden_states, inputs.cu_seqlens, inputs.initial_state, TINY_CONFIG)
    exact = layer_longdouble(*args)
    truth = layer_truth(*args)
    single = layer_truth(*args, dtype=np.float32)
    for name in fmt.TRUTH_NAMES:
        assert truth[name].dtype == np.float64, name
        assert relative_error(truth[name], exact[name]) < FLOAT64_BOUND, name
    assert relative_error(single["out"].astype(np.longdouble), exact["out"]) > 100 * FLOAT64_BOUND


def reference_run(config: KDAConfig, case_id: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """transformers' fp32 layer and the truth on one case: (reference results, truth), by dump name."""
    weights = synthetic_weights(config, seed=0)
    inputs = case_inputs(CASES_BY_ID[case_id], config, seed=0)
    state = None if inputs.initial_state is None else torch.from_numpy(inputs.initial_state)
    runner = TransformersReference(config, "cpu").build(weights, torch.float32)
    with torch.no_grad():
        run = runner.run(torch.from_numpy(inputs.hidden_states), inputs, state)
    reference = {"out": run.out.numpy(), **{name: a.numpy() for name, a in run.intermediates.items()}}
    truth = layer_truth(weights, inputs.hidden_states, inputs.cu_seqlens, inputs.initial_state, config)
    return reference, truth


@pytest.mark.parametrize("case_id", ["T65", "varlen_initstate"])
def test_truth_is_the_reference_math(case_id: str) -> None:
    """transformers' fp32 layer agrees with the truth to fp32 accuracy, output and every intermediate."""
    reference, truth = reference_run(TINY_CONFIG, case_id)
    for name, value in reference.items():
        np.testing.assert_allclose(value, truth[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_dump_stores_the_truth_of_both_runs(transformers_set: Path) -> None:
    """Every case: the truth of both runs under the contract's keys, float64, of the right shapes."""
    manifest = read_manifest(str(transformers_set))
    assert manifest["truth"] == {
        "dtype": "float64",
        "implementation": IMPLEMENTATION,
        "names": list(fmt.TRUTH_NAMES),
        "intermediates_max_tokens": 1024,
    }
    for case in manifest["cases"]:
        arrays = read_npz(str(transformers_set), case["file"], case["sha256"])
        spec = fmt.CASES_BY_ID[case["id"]]
        for dtype in fmt.DTYPES:
            for name in fmt.TRUTH_NAMES:
                key = fmt.truth_key(name, dtype)
                shape = fmt.expected_shape(
                    name, tokens=spec.total_tokens, num_seqs=len(spec.seq_lens), config=manifest["config"]
                )
                assert key in case["keys"] and arrays[key].dtype == np.float64, key
                assert arrays[key].shape == shape, key
    assert fmt.truth_key("out", "fp32") == "out_fp64"
    assert fmt.truth_key("o_norm", "bf16") == "o_norm_bf16_fp64"


def test_bf16_truth_sees_the_bf16_inputs(transformers_set: Path) -> None:
    """The bf16 run's truth is computed from bf16-rounded hidden states and weights (A_log and dt_bias
    kept fp32), and the bf16 reference output sits within bf16 accuracy of it."""
    manifest = read_manifest(str(transformers_set))
    case = next(entry for entry in manifest["cases"] if entry["id"] == "T65")
    arrays = read_npz(str(transformers_set), case["file"], case["sha256"])
    weights = read_npz(str(transformers_set), "weights.npz", manifest["weights"]["sha256"])
    expected = layer_truth(
        run_weights(weights, "bf16", TINY_CONFIG),
        bf16_rounded(arrays["hidden_states"]),
        arrays["cu_seqlens"],
        None,
        TINY_CONFIG,
    )
    np.testing.assert_array_equal(arrays["out_bf16_fp64"], expected["out"])
    for name, rounded in run_weights(weights, "bf16", TINY_CONFIG).items():
        if name in ("A_log", "dt_bias"):
            np.testing.assert_array_equal(rounded, weights[name], err_msg=name)
        else:
            assert not np.array_equal(rounded, weights[name]), name
            fmt.float32_to_bf16_bits(rounded)  # raises unless every value is a bf16 value
    assert not np.array_equal(arrays["out_bf16_fp64"], arrays["out_fp64"])
    out_bf16 = fmt.bf16_bits_to_float32(arrays["out_bf16"])
    truth = arrays["out_bf16_fp64"]
    assert np.linalg.norm(out_bf16 - truth) / np.linalg.norm(truth) < 1e-2


def test_intermediates_truth_only_for_short_cases(tmp_path: Path) -> None:
    """--truth-intermediates-max-tokens N: the intermediates' truth for cases of N tokens or fewer only."""
    assert (
        main(["--out", str(tmp_path), *TINY, "--cases", "T1", "T8", "--truth-intermediates-max-tokens", "1"])
        == 0
    )
    manifest = read_manifest(str(tmp_path))
    assert manifest["truth"]["intermediates_max_tokens"] == 1
    keys = {case["id"]: case["keys"] for case in manifest["cases"]}
    for dtype in fmt.DTYPES:
        assert fmt.truth_key("o_norm", dtype) in keys["T1"]
        assert fmt.truth_key("o_norm", dtype) not in keys["T8"]
        assert fmt.truth_key("out", dtype) in keys["T8"]
        assert fmt.truth_key("recurrent_state", dtype) in keys["T8"]


def test_negative_intermediates_limit_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), *TINY, "--truth-intermediates-max-tokens", "-1"]) == 2
    assert "--truth-intermediates-max-tokens must be >= 0, got -1" in capsys.readouterr().err


def test_reader_reads_the_truth(transformers_set: Path) -> None:
    """The conformance reader keeps every truth array as stored, float64."""
    dumps = DumpSet(str(transformers_set))
    assert dumps.verify() == []
    for case_id in CASES:
        case = dumps.case(case_id)
        raw = read_npz(str(transformers_set), case.info.file, case.info.sha256)
        for dtype in fmt.DTYPES:
            for name in fmt.TRUTH_NAMES:
                key = fmt.truth_key(name, dtype)
                assert case.arrays[key].dtype == np.float64
                np.testing.assert_array_equal(case.arrays[key], raw[key])


@pytest.mark.parametrize(
    ("key", "damage", "message"),
    [
        ("out_fp64", lambda a: a[:-1], "key 'out_fp64': expected shape (65, 32), found (64, 32)"),
        (
            "recurrent_state_bf16_fp64",
            lambda a: a[..., :-1],
            "key 'recurrent_state_bf16_fp64': expected shape (1, 2, 16, 16), found (1, 2, 16, 15)",
        ),
        (
            "g_out_fp64",
            lambda a: a.astype(np.float32),
            "key 'g_out_fp64': expected dtype float64, found float32",
        ),
    ],
)
def test_reader_refuses_a_bad_truth_array(
    transformers_set: Path,
    tmp_path: Path,
    key: str,
    damage: Callable[[np.ndarray], np.ndarray],
    message: str,
) -> None:
    """A truth array of the wrong shape or dtype is refused, naming the file's key."""
    root = tmp_path / "set"
    shutil.copytree(transformers_set, root)
    manifest = read_manifest(str(root))
    entry = next(case for case in manifest["cases"] if case["id"] == "T65")
    arrays = read_npz(str(root), entry["file"], entry["sha256"])
    arrays[key] = damage(arrays[key])
    data = npz_bytes(arrays)
    (root / entry["file"]).write_bytes(data)
    entry["sha256"] = fmt.sha256_bytes(data)
    (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=re.escape(message)):
        DumpSet(str(root)).case("T65")


def test_softplus_and_sigmoid_at_the_extremes() -> None:
    """softplus is z itself above 20 (the reference's threshold), log1p(exp(z)) below; neither overflows."""
    z = np.array([-1000.0, -5.0, 20.0, 20.5, 1000.0])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        np.testing.assert_array_equal(softplus(z)[2:], [np.log1p(np.exp(20.0)), 20.5, 1000.0])
        np.testing.assert_allclose(softplus(z)[:2], [0.0, np.log1p(np.exp(-5.0))], rtol=1e-15, atol=0)
        np.testing.assert_allclose(sigmoid(z[1:4]), 1 / (1 + np.exp(-z[1:4])), rtol=1e-15, atol=0)
        np.testing.assert_array_equal(sigmoid(z[[0, 4]]), [0.0, 1.0])
