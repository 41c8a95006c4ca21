"""The report's tables and wording: each row under its dtype's RFC tolerance, shares in significant digits."""

from __future__ import annotations

import numpy as np

from conformance.checks.catalogue import CheckSpec
from conformance.judging.measurement import percent
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary
from conformance.reports.render import markdown, terminal_lines
from conformance.reports.report import Record, build_report
from tests.conformance.absolute import compare

POLICY = TolerancePolicy.load()


def _report() -> dict:
    reference = np.ones((40, 8), np.float32)
    records = []
    for dtype, error in (("fp32", 0.0), ("bf16", 5e-3)):
        actual = reference.copy()
        actual[0, 0] += error
        comparison = compare(actual, reference, POLICY.gate[dtype], POLICY.rfc[dtype], ("token", "channel"))
        spec = CheckSpec("T40", dtype, "layer")
        records.append(Record(spec, "passed", summary(comparison), 0.1, comparison))
    meta = {
        "implementation": {"impl": "x|y", "name": "n", "kernel": "auto", "kernel_used": {}},
        "environment": {"backend": "cpu", "device_kind": "cpu", "versions": {}},
        "dumps": {"url": "golden", "manifest": {"config": {}}},
        "tolerances": POLICY.as_dict(),
    }
    return build_report(records, meta, POLICY.close_margin)


def test_each_row_names_its_dtypes_rfc_tolerance() -> None:
    lines = terminal_lines(_report())
    header = next(line for line in lines if line.startswith("case"))
    assert "RFC tolerance" in header and "1e-3" not in header
    assert next(line for line in lines if "fp32" in line).endswith("1e-5: holds")
    assert next(line for line in lines if " bf16 " in line).endswith("1e-3: 1/1 out")


def test_markdown_tables_come_out_well_formed() -> None:
    text = markdown(_report())
    summary = text[text.index("## Summary") :].splitlines()
    table = [line for line in summary if line.startswith("|")]
    assert table[0].startswith("| case ") and "RFC tolerance" in table[0]
    assert set(table[1]) <= {"|", "-", ":"}
    assert len({line.count("|") for line in table[:4]}) == 1
    assert "1e-5: holds" in table[2] and "1e-3: 1/1 out" in table[3]
    numbers = text[text.index("## Every check") :]
    assert "| 1 (0.31%)" in numbers  # 1 element of 320 outside the RFC's bf16 tolerance


def test_shares_keep_two_significant_digits() -> None:
    assert percent(1 / 32768) == "0.0031%"
    assert percent(1 / 4_194_304) == "0.000024%"
    assert percent(0.5) == "50%"
    assert percent(0.0) == "0%"
    reference = np.ones(32768, np.float32)
    actual = reference.copy()
    actual[7] = 2.0
    comparison = compare(actual, reference, POLICY.gate["fp32"], POLICY.rfc["fp32"])
    assert comparison.failures[0].startswith("1 of 32768 elements (0.0031%) outside")
