"""What sglang-jax's prefill computes with `safe_gate=True` and no `lower_bound` (issue 42).

sglang-jax's `KDAAttnBackend._forward_extend` calls its Pallas `chunk_kda_fwd` with the gate in the kernel
(`use_gate_in_kernel=True`, `A_log`, `dt_bias`) and leaves `safe_gate` at its default, True, and
`lower_bound` at None, on Kimi-Linear's unbounded softplus gate. This runs the adapter's layer path
(examples/sglang_jax/adapter.py: that very call, inside sglang-jax's backend) twice on each case of a
dump set: as sglang-jax calls it, and with the backend's `chunk_kda` replaced by the same function with
`safe_gate=False`; it prints, per case and dtype, both runs' distance to the float64 truth of `out` and
of the final recurrent state, and the largest difference between the two runs. It also traces the
backend's call both ways and says whether the two programs (jaxprs) are the same.

    python -m examples.sglang_jax.safe_gate --dumps DIR --sglang-jax PATH [--cases ID ...] \
        [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
from collections.abc import Iterator, Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from conformance.checks.calls import ImplementationCalls
from conformance.dumps.reader import CaseData, DumpSet
from conformance.judging.measurement import normalised_rmse
from examples.sglang_jax.adapter import SglangJaxAdapter, import_sgl_jax, stub_server_modules
from kda_spec import dump_format as fmt

BACKEND_MODULE = "sgl_jax.srt.layers.attention.linear.kda_backend"
VARIANTS = ("as called", "safe_gate=False")


@contextlib.contextmanager
def backend_call(variant: str) -> Iterator[None]:
    """sglang-jax's backend with its chunk kernel called as it is (`as called`), or with
    `safe_gate=False` added to that call."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "as called":
        yield
        return
    backend = importlib.import_module(BACKEND_MODULE)
    with mock.patch.object(backend, "chunk_kda", functools.partial(backend.chunk_kda, safe_gate=False)):
        yield


def layer_run(
    dumps: DumpSet, case: CaseData, dtype: str, checkout: str, variant: str
) -> dict[str, np.ndarray]:
    """`out` [T, hidden] and `final_state` [N, H, D, D] of one prefill of `case` through the adapter's
    layer path, the backend's chunk call as `variant` says; a new adapter, so that the call is traced
    afresh."""
    with backend_call(variant):
        adapter = SglangJaxAdapter(
            dumps.config, dumps.weights(), dtype, "auto", options={"sglang_jax": checkout}
        )
        x = ImplementationCalls.inputs(case, dtype)
        result = adapter.layer_extend(x, case.cu_seqlens, case.initial_state)
    return {"out": np.asarray(result.out), "recurrent_state": np.asarray(result.final_state)}


def traced_programs_equal(checkout: str, tokens: int = 128, heads: int = 2, dim: int = 64) -> bool:
    """Whether the backend's chunk call traces to the same program (jaxpr, Pallas kernels included) with
    `safe_gate` True and False (one sequence of `tokens` tokens, `heads` heads of `dim`, fp32)."""
    import_sgl_jax(checkout)
    stub_server_modules()
    chunk_kda = importlib.import_module("sgl_jax.srt.kernels.kda").chunk_kda
    f32 = jnp.float32
    qkvg = jax.ShapeDtypeStruct((1, tokens, heads, dim), f32)
    arguments = (
        *(qkvg,) * 4,
        jax.ShapeDtypeStruct((1, tokens, heads), f32),  # beta
        jax.ShapeDtypeStruct((1, heads, dim, dim), f32),  # initial_state
        jax.ShapeDtypeStruct((2,), jnp.int32),  # cu_seqlens
        jax.ShapeDtypeStruct((heads,), f32),  # A_log
        jax.ShapeDtypeStruct((heads, dim), f32),  # dt_bias
    )

    def traced(safe_gate: bool) -> str:
        def call(q, k, v, g, beta, initial_state, cu_seqlens, a_log, dt_bias):
            return chunk_kda(
                q, k, v, g, beta,
                scale=dim**-0.5, initial_state=initial_state, output_final_state=True,
                cu_seqlens=cu_seqlens, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                safe_gate=safe_gate,
            )  # fmt: skip

        return str(jax.make_jaxpr(call)(*arguments))

    return traced(True) == traced(False)


def case_rows(dumps: DumpSet, case_id: str, dtype: str, checkout: str) -> list[str]:
    """Markdown rows of one case and dtype: each variant's nRMSE against the truth of `out` and of the
    final state, and the largest difference between the variants."""
    case = dumps.case(case_id)
    if not case.has_dtype(dtype):
        return [f"| {case_id} | {dtype} | (not in the set) | | | |"]
    runs = {variant: layer_run(dumps, case, dtype, checkout, variant) for variant in VARIANTS}
    g_truth = case.arrays.get(fmt.truth_key("g", dtype))
    gate = "" if g_truth is None else f"{float(np.min(g_truth)):.1f}"
    rows = []
    for name in ("out", "recurrent_state"):
        truth = np.asarray(case.arrays[fmt.truth_key(name, dtype)], np.float64)
        errors = [normalised_rmse(runs[v][name] - truth, truth) for v in VARIANTS]
        between = float(np.max(np.abs(runs[VARIANTS[0]][name] - runs[VARIANTS[1]][name])))
        rows.append(
            f"| {case_id} | {dtype} | {name} | {gate} | {errors[0]:.3g} | {errors[1]:.3g} | {between:.3g} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.sglang_jax.safe_gate", description=__doc__)
    parser.add_argument("--dumps", required=True, help="a Kimi-Linear dump set (e.g. --weights stress)")
    parser.add_argument("--sglang-jax", required=True, help="the sglang-jax checkout")
    parser.add_argument("--cases", nargs="+", help="case ids (default: every case of the set)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(fmt.DTYPES))
    args = parser.parse_args(argv)
    dumps = DumpSet(args.dumps)
    if dumps.config.family != "kimi-linear":
        raise ValueError(f"--dumps {args.dumps}: a {dumps.config.family!r} set; this runs Kimi-Linear's gate")
    unknown = sorted(set(args.cases or ()) - set(dumps.cases))
    if unknown:
        raise ValueError(f"--cases: {unknown} not in {args.dumps} (it has {sorted(dumps.cases)})")
    same = traced_programs_equal(args.sglang_jax)
    print(
        f"the backend's chunk call, safe_gate True vs False: {'the same' if same else 'different'} programs"
    )
    print(
        "| case | dtype | result | min g (truth) | nRMSE vs truth, as called | nRMSE, safe_gate=False "
        "| max abs between |"
    )
    print("|---|---|---|---|---|---|---|")
    for case_id in args.cases or sorted(dumps.cases):
        for dtype in args.dtypes:
            for row in case_rows(dumps, case_id, dtype, args.sglang_jax):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
