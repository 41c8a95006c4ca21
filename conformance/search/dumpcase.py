"""A generated case as a format-v1 dump set (docs/dump-format.md), computed with numpy alone.

The set's reference is the **plain fp32 pipeline**: the layer's math of `kda_spec.truth` run in
float32 (in a bf16 run: rounding to bf16 at the precision contract's points, docs/bf16-rounding.md),
the kernel results its float32 token recurrence on the dumped kernel inputs. Its truth is the same math
in float64 without roundings, as `dump_gen` stores it. `conformance run` on such a set therefore judges
an implementation by how much further from the truth it is than a plain fp32 recurrence on the same
inputs: the relative gate of docs/tolerance-policy.md, with this pipeline as its reference.

The judge writes each case to an in-memory set (`memory://`) and reads it back through the suite's own
reader; a reproducer is the same set on disk (`reproducer.py`). Writing goes through
`kda_spec.dump_writer` onto `kda_spec.storage` (numpy and fsspec only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from conformance.search.space import CaseInputs, SearchCase, case_inputs
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.dump_writer import DumpSetWriter, TruthBlock
from kda_spec.storage import open_writer
from kda_spec.truth import (
    IMPLEMENTATION,
    bf16_contract_rounding,
    bf16_rounded,
    l2_normalised,
    layer_truth,
    packed_delta_rule,
    run_hidden_states,
    run_weights,
)

CASE_ID = "search"
REFERENCE = {
    "name": "plain fp32 pipeline",
    "description": (
        "kda_spec.truth's layer in float32 (the bf16 run rounding to bf16 at the precision contract's "
        "points); the kernel results its float32 token recurrence on the dumped kernel inputs"
    ),
    "versions": {"numpy": np.__version__},
    "device": "cpu",
}
KERNEL_PATHS = ("chunk", "fused_recurrent")


def plain_pipeline(
    hidden_states: np.ndarray,  # [T, hidden]
    cu_seqlens: np.ndarray,  # [N+1]
    initial_state: np.ndarray | None,  # [N, H, D, D]
    weights: Mapping[str, np.ndarray],
    config: KDAConfig,
    dtype: str,
) -> dict[str, np.ndarray]:
    """The plain fp32 pipeline's layer results by dump name on `hidden_states` (the case's, or others);
    the bf16 run's rounding as the precision contract rounds."""
    rounded = bf16_contract_rounding if dtype == "bf16" else None
    x = run_hidden_states(hidden_states, dtype)
    return layer_truth(
        run_weights(weights, dtype, config), x, cu_seqlens, initial_state, config, np.float32, rounded
    )


def case_arrays(
    inputs: CaseInputs, weights: Mapping[str, np.ndarray], config: KDAConfig, dtype: str
) -> dict[str, np.ndarray]:
    """Every array of the case file of one run (`dtype`): the inputs, the plain fp32 pipeline's results
    (the reference) and their float64 truth. `weights` float32 by HF name."""
    x, cu, init = inputs.hidden_states, inputs.cu_seqlens, inputs.initial_state
    reference = plain_pipeline(x, cu, init, weights, config, dtype)
    truth = layer_truth(run_weights(weights, dtype, config), run_hidden_states(x, dtype), cu, init, config)
    arrays: dict[str, np.ndarray] = {"hidden_states": x, "cu_seqlens": cu}
    if init is not None:
        arrays["initial_recurrent_state"] = init
    q, k = (l2_normalised(reference[name]) for name in ("q_after_conv", "k_after_conv"))
    o, state = packed_delta_rule(q, k, reference["v_after_conv"], reference["g"], reference["beta"], cu, init)
    if dtype == "bf16":
        o = bf16_rounded(o)  # the kernel's output in the run dtype, as the reference kernel returns it
    arrays[fmt.result_key("out", dtype)] = fmt.stored_result(reference["out"], "out", dtype)
    for path in KERNEL_PATHS:
        arrays[fmt.result_key(f"o_kda_{path}", dtype)] = fmt.stored_result(o, f"o_kda_{path}", dtype)
        arrays[fmt.result_key(f"recurrent_state_{path}", dtype)] = state
    for name in (*fmt.INTERMEDIATE_KEYS, *fmt.OPTIONAL_INTERMEDIATE_KEYS):
        arrays[fmt.result_key(name, dtype)] = fmt.stored_result(reference[name], name, dtype)
    for name in fmt.TRUTH_NAMES:
        arrays[fmt.truth_key(name, dtype)] = np.asarray(truth[name], np.float64)
    return arrays


def write_case_set(
    url: str,
    case: SearchCase,
    weights: Mapping[str, np.ndarray],
    config: KDAConfig,
    weights_source: str,
    search: Mapping[str, Any],
    overwrite: bool = False,
) -> None:
    """`case` on `weights` (float32 by HF name) as a dump set of one case (`CASE_ID`) at `url` (a folder
    or `memory://…`), written by `kda_spec.dump_writer` through `kda_spec.storage` (a local folder staged
    and swapped in whole). The manifest's `search` block holds the case's fields and `search` (what the
    search says of it: the check it failed)."""
    arrays = case_arrays(case_inputs(case, weights, config), weights, config, case.dtype)
    spec = fmt.CaseSpec(CASE_ID, case.seq_lens, initial_state="initial_recurrent_state" in arrays)
    with open_writer(url, overwrite=overwrite) as writer:
        dump_set = DumpSetWriter(writer)
        float32_weights = {name: np.asarray(w, np.float32) for name, w in weights.items()}
        dump_set.write_weights(float32_weights, weights_source)
        dump_set.write_case(spec, arrays, sorted_keys=True)
        dump_set.commit(
            config=config,
            reference=REFERENCE,
            seed=case.seed,
            generator="conformance.search",
            truth=TruthBlock(IMPLEMENTATION, fmt.TRUTH_NAMES, intermediates_max_tokens=case.tokens),
            search={"case": case.as_dict(), **search},
        )
