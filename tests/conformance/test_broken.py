"""The suite can fail: each deliberately broken kda_impl fails, on golden, the checks that cover its bug."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checks.catalogue import CheckSkipped, CheckSpec, plan
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.judging.comparison import Comparison
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary
from conformance.reports.report import Record, build_report
from conformance.tools.gate import breaches
from tests.conformance import broken_adapters
from tests.conformance.numpy_adapter import NumpyAdapter

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

# adapter → (case, dtype) → (checks that must fail, checks that must still hold)
EXPECTATIONS = {
    broken_adapters.FlippedGate: (
        ("T65", "fp32"),
        {"layer", "layer-state", "g", "o_norm", "decode-k8", "chunked-prefill"},
        {"kernel-chunk", "q_after_conv", "beta", "g_out"},
    ),
    broken_adapters.LeakyConv: (
        ("varlen_unbalanced_5_17_1_41", "bf16"),
        {"layer", "q_after_conv", "k_after_conv", "v_after_conv", "o_norm", "decode-k8"},
        {"g", "beta", "g_out"},
    ),
    broken_adapters.DecodeDropsConvState: (
        ("T65", "bf16"),
        {"decode-k1", "decode-k1-self", "decode-k8", "decode-k8-self"},
        {"layer", "layer-state", "chunked-prefill"},
    ),
    broken_adapters.OutputOffset: (
        ("varlen_initstate", "fp32"),
        {"layer", "decode-k1", "decode-k8"},
        {"o_norm", "layer-state", "decode-k8-self"},
    ),
    # golden's reference (transformers) rounds beta to bf16 too: the precision contract catches it.
    broken_adapters.BetaInBf16: (
        ("T65", "bf16"),
        {"beta", "layer", "layer-state"},
        {"q_after_conv", "g", "g_out", "kernel-chunk"},
    ),
}


def _comparisons(adapter_class: type, case: str, dtype: str, checks: set[str]) -> dict[CheckSpec, Comparison]:
    runner = CheckRunner(DumpSet(str(GOLDEN)), adapter_class, "auto", TolerancePolicy.load())
    return {
        spec: runner.run(spec).comparison
        for spec in (CheckSpec(case, dtype, check) for check in sorted(checks))
    }


@pytest.mark.parametrize("adapter_class", list(EXPECTATIONS), ids=lambda cls: cls.__name__)
def test_broken_adapter_fails_the_matching_checks_and_the_gate(adapter_class: type) -> None:
    (case, dtype), must_fail, must_hold = EXPECTATIONS[adapter_class]
    comparisons = _comparisons(adapter_class, case, dtype, must_fail | must_hold)
    verdicts = {spec.check: c.passed for spec, c in comparisons.items()}
    assert {check for check in must_fail if verdicts[check]} == set(), "broken checks that still passed"
    assert {check for check in must_hold if not verdicts[check]} == set(), "unrelated checks that failed"
    records = [
        Record(spec, "passed" if c.passed else "failed", summary(c), 0.0, c)
        for spec, c in comparisons.items()
    ]
    found = breaches(build_report(records, {}, close_margin=0.5))
    assert sorted(line.split(":")[0] for line in found) == sorted(
        f"{case}-{dtype}-{check}" for check in must_fail
    )


def test_output_offset_is_below_bf16_resolution() -> None:
    (comparison,) = _comparisons(broken_adapters.OutputOffset, "T65", "bf16", {"layer"}).values()
    assert comparison.passed


# The cases the numpy reference is held to on golden: one and several sequences, an initial state, a
# 1-token sequence, and decodes of every token.
REFERENCE_CASES = ["T1", "T8", "T65", "varlen_unbalanced_5_17_1_41", "varlen_initstate"]


def test_numpy_reference_passes_every_check_on_golden() -> None:
    """The numpy reference writes the synthetic dump sets of the other tests: hold it to golden, which
    transformers' torch layer computed, so that its own dumps are not its only oracle."""
    dumps = DumpSet(str(GOLDEN))
    runner = CheckRunner(dumps, NumpyAdapter, "auto", TolerancePolicy.load())

    failed, ran = [], 0
    for spec in plan(dumps, REFERENCE_CASES, ["fp32", "bf16"]):
        try:
            comparison = runner.run(spec).comparison
        except CheckSkipped:
            continue
        ran += 1
        if not comparison.passed:
            failed.append(f"{spec.id}: {summary(comparison)}")
    assert failed == [] and ran > 150
