"""The built-in adapter holds on the committed golden set: a representative subset (`make conform`: all)."""

from __future__ import annotations

from pathlib import Path

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, case_checks, plan
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary
from kda_spec import dump_format as fmt

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
# One token; one chunk plus one token; a packed batch of uneven sequences with initial states.
CASES = ["T1", "T65", "varlen_initstate"]
LAYER_GRADIENT_KINDS = (kinds.LAYER_GRAD_X, kinds.LAYER_GRAD_H0, kinds.LAYER_GRAD_WEIGHT)


def test_kda_impl_holds_on_golden() -> None:
    dumps = DumpSet(str(GOLDEN))
    runner = CheckRunner(dumps, KDAImplAdapter, "auto", TolerancePolicy.load())
    failed, skipped, passed = [], set(), 0
    for spec in plan(dumps, CASES, ["fp32", "bf16"]):
        try:
            comparison = runner.run(spec).comparison
        except CheckSkipped:
            skipped.add(spec.id)
            continue
        if comparison.passed:
            passed += 1
        else:
            failed.append(f"{spec.id}: {summary(comparison)}")
    assert failed == []
    # Only what cannot run: nothing to decode, split or cut in T1 (nor a gate gradient: from a zero initial
    # state one token's results do not depend on its decay, the truth is zero), no chunked prefill with a
    # 1-token sequence, and the bf16 layer gradients of the cases golden stores no reference's gradients of
    # (all but T65).
    gate_path = ["layer-grad-f_a_proj", "layer-grad-f_b_proj", "layer-grad-A_log", "layer-grad-dt_bias"]
    layer_gradients = [check.name for check in case_checks((1,)) if check.kind in LAYER_GRADIENT_KINDS]
    expected_skips = {
        f"{case}-{dtype}-{check}"
        for dtype in ("fp32", "bf16")
        for case, checks in {
            "T1": [f"decode-{k}{s}" for k in ("k1", "k8", "all") for s in ("", "-self")]
            + ["chunked-prefill", "chunked-prefill-state", "kernel-chunk-grad-g"]
            + ["kernel-chunk-causal", "kernel-chunk-grad-causal", "layer-causal", "layer-grad-causal"]
            + (gate_path if dtype == "fp32" else layer_gradients),
            "varlen_initstate": ["chunked-prefill", "chunked-prefill-state"]
            + (layer_gradients if dtype == "bf16" else []),
        }.items()
        for check in checks
    }
    if fmt.GATE_INPUT_KEY not in dumps.cases["T1"].keys:  # a golden set made before the raw gate
        expected_skips |= {
            f"{case}-{dtype}-{kind.name()}"
            for case in CASES
            for dtype in ("fp32", "bf16")
            for kind in kinds.RAW_GATE_KERNEL_KINDS
        }
    assert skipped == expected_skips
    assert passed == len(plan(dumps, CASES, ["fp32", "bf16"])) - len(expected_skips)
