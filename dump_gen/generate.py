"""One dump set, case by case: run the reference in fp32 and bf16, both kernel paths on its own q, k, v,
g, beta, the float64 truth of both runs (kda_spec.truth), and write the arrays, the weights and (last)
the manifest. Non-finite weights or results are refused: a reference holding NaN or Inf is no reference.
"""

from __future__ import annotations

import importlib.metadata
from collections import Counter
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from dump_gen.errors import DumpError
from dump_gen.gradients import gradient_arrays
from dump_gen.inputs import CaseInputs, case_inputs
from dump_gen.kernels import PATHS, KernelBackend, KernelCall, kernel_backend
from dump_gen.precision import precision_block
from dump_gen.references.base import LayerRunner, Reference
from kda_spec.config import KDAConfig
from kda_spec.dump_format import (
    FP32_IN_BF16_RUN,
    INTERMEDIATE_KEYS,
    KERNEL_KEYS,
    LONG_GROUP,
    LONG_RESULT_NAMES,
    OPTIONAL_INTERMEDIATE_KEYS,
    OUTPUT_KEY,
    TRUTH_NAMES,
    CaseSpec,
    decode_array,
    expected_shape,
    result_key,
    truth_key,
)
from kda_spec.dump_writer import DumpSetWriter, TruthBlock
from kda_spec.gradients import default_gradient_cases
from kda_spec.storage import DumpWriter
from kda_spec.truth import (
    BLOCK_TOKENS,
    INTERMEDIATES_MAX_TOKENS,
    layer_output_truth,
    layer_truth,
    run_hidden_states,
    run_weights,
)
from kda_spec.truth import IMPLEMENTATION as TRUTH_IMPLEMENTATION

RUN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RESULT_ORDER = (OUTPUT_KEY, *KERNEL_KEYS, *INTERMEDIATE_KEYS, *OPTIONAL_INTERMEDIATE_KEYS)
# The truth of the output and the final states is stored for every case, that of the intermediates for
# cases of at most `truth_intermediates_max_tokens` (kda_spec.truth.INTERMEDIATES_MAX_TOKENS).
TRUTH_ALWAYS = (OUTPUT_KEY, "recurrent_state")


def generator_name() -> str:
    try:
        return f"dump_gen {importlib.metadata.version('kda-conformance')}"
    except importlib.metadata.PackageNotFoundError:
        return "dump_gen (not installed)"


def stored_array(name: str, tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """How result `name` of the `dtype` run is stored: float32 values, or raw bf16 bits as uint16.

    In the bf16 run the states, `g` and `beta` are stored as float32 (bf16 values upcast exactly); any
    other result is stored as bits when the reference left it in bf16, as float32 when it kept it in fp32.
    """
    tensor = tensor.detach().cpu()
    if dtype == "fp32" and tensor.dtype != torch.float32:
        raise RuntimeError(f"the fp32 run produced {name!r} in {tensor.dtype}")
    if tensor.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"the {dtype} run produced {name!r} in {tensor.dtype}")
    if tensor.dtype == torch.bfloat16 and name not in FP32_IN_BF16_RUN:
        return tensor.contiguous().view(torch.uint16).numpy()
    return tensor.float().contiguous().numpy()


def check_finite(array: np.ndarray, what: str) -> None:
    """A DumpError naming `what` when `array` (float32 values or bf16 bits) holds NaN or Inf."""
    bad = int(np.count_nonzero(~np.isfinite(decode_array(array))))
    if bad:
        raise DumpError(f"{what} holds NaN or Inf ({bad} of {array.size} values); refusing to write it")


def run_hidden(inputs: CaseInputs, dtype: str, device: str) -> torch.Tensor:
    """The case's hidden states as the `dtype` run takes them: [T, hidden] in its dtype."""
    return torch.from_numpy(inputs.hidden_states).to(device=device, dtype=RUN_DTYPES[dtype])


def run_dtype(
    runner: LayerRunner, kernels: KernelBackend, inputs: CaseInputs, dtype: str, device: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every result of one case in one dtype by its dump name, and the layer's kernel path per sequence."""
    hidden = run_hidden(inputs, dtype, device)
    state = None if inputs.initial_state is None else torch.from_numpy(inputs.initial_state).to(device)
    with torch.no_grad():
        layer = runner.run(hidden, inputs, state)
        results = {OUTPUT_KEY: layer.out}
        call = KernelCall(
            **layer.kernel_inputs, spans=inputs.spans, packed=inputs.packed, initial_state=state
        )
        for path in PATHS:
            kernel = kernels.run(path, call)
            results[f"o_kda_{path}"] = kernel.o[0]
            results[f"recurrent_state_{path}"] = kernel.final_state
    results.update(layer.intermediates)
    return results, layer.kernel_paths


def result_names(case: CaseSpec) -> tuple[str, ...]:
    """The results stored of each run of `case`: all of them, or the output and the final states of a
    long case (its [T, H, D] kernel outputs and intermediates would be gigabytes at the real size)."""
    return LONG_RESULT_NAMES if case.group == LONG_GROUP else RESULT_ORDER


def truth_names(case: CaseSpec, intermediates_max_tokens: int) -> tuple[str, ...]:
    """The truth names stored for `case`: all of them for a short case, the output and states otherwise."""
    return TRUTH_NAMES if case.total_tokens <= intermediates_max_tokens else TRUTH_ALWAYS


def truth_arrays(
    case: CaseSpec,
    inputs: CaseInputs,
    weights_by_dtype: dict[str, dict[str, np.ndarray]],
    config: KDAConfig,
    names: tuple[str, ...],
) -> dict[str, np.ndarray]:
    """The float64 truth of each run of `case`, from exactly the hidden states and weights that run saw
    (the initial state stays float32 in both runs), under its `truth_key`s."""
    shape_config = config.to_manifest()
    arrays = {}
    for dtype, weights in weights_by_dtype.items():
        hidden = run_hidden_states(inputs.hidden_states, dtype)
        if set(names) <= set(TRUTH_ALWAYS) and case.total_tokens > BLOCK_TOKENS:  # a long case, in blocks
            results = layer_output_truth(weights, hidden, inputs.cu_seqlens, inputs.initial_state, config)
        else:
            results = layer_truth(weights, hidden, inputs.cu_seqlens, inputs.initial_state, config)
        for name in names:
            key, array = truth_key(name, dtype), results[name]
            shape = expected_shape(
                name, tokens=case.total_tokens, num_seqs=len(case.seq_lens), config=shape_config
            )
            if array.shape != shape or array.dtype != np.float64:
                raise RuntimeError(
                    f"case {case.case_id}: truth {key!r} is {array.dtype} {array.shape}, expected "
                    f"float64 {shape}"
                )
            check_finite(array, f"case {case.case_id}: truth {key!r}")
            arrays[key] = array
    return arrays


def case_arrays(
    case: CaseSpec,
    inputs: CaseInputs,
    runners: dict[str, LayerRunner],
    kernels: KernelBackend,
    config: KDAConfig,
    device: str,
    gradients: bool = False,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays of one case file, in order, and the layer's kernel path per sequence (from the fp32 run);
    with `gradients`, each run's reference gradients and their cotangents too (dump_gen.gradients)."""
    arrays = {"hidden_states": inputs.hidden_states, "cu_seqlens": inputs.cu_seqlens}
    if inputs.initial_state is not None:
        arrays["initial_recurrent_state"] = inputs.initial_state
    shape_config = config.to_manifest()
    paths_by_dtype = {}
    for dtype, runner in runners.items():
        results, paths_by_dtype[dtype] = run_dtype(runner, kernels, inputs, dtype, device)
        for name in result_names(case):
            array = stored_array(name, results[name], dtype)
            shape = expected_shape(
                name, tokens=case.total_tokens, num_seqs=len(case.seq_lens), config=shape_config
            )
            if array.shape != shape:
                raise RuntimeError(
                    f"case {case.case_id}: {dtype} result {name!r} has shape {array.shape}, expected {shape}"
                )
            key = result_key(name, dtype)
            check_finite(array, f"case {case.case_id}: reference result {key!r}")
            arrays[key] = array
        if gradients:
            hidden = run_hidden(inputs, dtype, device)
            found = gradient_arrays(runner, kernels, inputs, results, hidden, case.case_id, dtype, config)
            for name, array in found.items():
                key = result_key(name, dtype)
                check_finite(array, f"case {case.case_id}: reference gradient {key!r}")
                arrays[key] = array
    if len({tuple(paths) for paths in paths_by_dtype.values()}) != 1:
        raise RuntimeError(
            f"case {case.case_id}: the layer took different kernels per dtype: {paths_by_dtype}"
        )
    return arrays, paths_by_dtype["fp32"]


def gradient_block(kernels: KernelBackend, cases: list[str], available: bool) -> dict[str, Any]:
    """The manifest's account of the gradient keys (kda_spec.gradients): which cases hold them and how the
    reference computed them."""
    if not available:
        return {"cases": [], "note": "this reference has no backward run here (no `vjp`): no gradients"}
    return {
        "cases": cases,
        "kernel": f"{kernels.VJP_PATH} path of {kernels.name} under torch autograd",
        "layer": "the reference layer under torch autograd (its patches name any kernel it swaps)",
        "cotangents": "kda_spec.gradients (seeded by the case id and the run's dtype), stored beside",
    }


def main_path(case: CaseSpec, paths: list[str]) -> str:
    """The kernel the layer used for most of the case's tokens."""
    tokens: Counter[str] = Counter()
    for path, length in zip(paths, case.seq_lens):
        tokens[path] += length
    return tokens.most_common(1)[0][0]


def generate(
    *,
    writer: DumpWriter,
    reference: Reference,
    config: KDAConfig,
    weights: dict[str, np.ndarray],
    weights_source: str,
    cases: tuple[CaseSpec, ...],
    seed: int,
    device: str,
    progress: bool = True,
    truth_intermediates_max_tokens: int = INTERMEDIATES_MAX_TOKENS,
    gradient_cases: Collection[str] | None = None,
) -> dict[str, Any]:
    """Write one dump set of `cases` to `writer`; returns the manifest, written last. The caller holds
    `writer` as a context manager, so that whatever stops the run (an error, Ctrl-C) undoes what it wrote.
    `gradient_cases`: the ids of the cases whose reference gradients it stores (None: the default,
    `kda_spec.gradients.default_gradient_cases`)."""
    for name, array in weights.items():
        check_finite(array, f"weight {name!r} ({weights_source})")
    dump_set = DumpSetWriter(writer)
    dump_set.write_weights(weights, weights_source)
    kernels = kernel_backend(device, config)
    runners = {dtype: reference.build(weights, torch_dtype) for dtype, torch_dtype in RUN_DTYPES.items()}
    truth_weights = {dtype: run_weights(weights, dtype, config) for dtype in RUN_DTYPES}
    stored_truth: set[str] = set()
    with_gradients = all(hasattr(runner, "vjp") for runner in runners.values())  # the hub's has none
    wanted = set(default_gradient_cases(cases) if gradient_cases is None else gradient_cases)
    stored_gradients: list[str] = []
    bar = tqdm(cases, desc="dump", unit="case", disable=not progress)
    for case in bar:
        bar.set_postfix_str(case.case_id)
        inputs = case_inputs(case, config, seed)
        gradients = with_gradients and case.case_id in wanted
        arrays, paths = case_arrays(case, inputs, runners, kernels, config, device, gradients)
        names = truth_names(case, truth_intermediates_max_tokens)
        arrays.update(truth_arrays(case, inputs, truth_weights, config, names))
        if gradients:
            stored_gradients.append(case.case_id)
        stored_truth.update(names)
        dump_set.write_case(
            case, arrays, layer_kernel_path=main_path(case, paths), layer_kernel_path_per_seq=paths
        )
    return dump_set.commit(
        config=config,
        reference={
            "name": reference.name,
            **reference.describe(),
            "kernel_keys": kernels.name,
            "gradients": gradient_block(kernels, stored_gradients, with_gradients),
        },
        precision=precision_block(device),  # read back after the runs: what they ran with
        seed=seed,
        generator=generator_name(),
        truth=TruthBlock(
            implementation=TRUTH_IMPLEMENTATION,
            names=tuple(name for name in TRUTH_NAMES if name in stored_truth),
            intermediates_max_tokens=truth_intermediates_max_tokens,
        ),
    )
