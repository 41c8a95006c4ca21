"""The numbers a check records, and its verdict."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conformance.judging.limits import Tolerance
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary
from tests.conformance.absolute import compare

FP32 = Tolerance(atol=1e-5, rtol=1e-5)
RFC_BF16 = Tolerance(atol=1e-3, rtol=1e-3)
BF16 = Tolerance(atol=1e-2, rtol=1e-2, max_nrmse=5e-3)


def test_records_every_number_and_the_worst_position() -> None:
    expected = np.zeros((3, 2, 4))
    expected[1, 1, 2] = 2.0
    actual = expected.copy()
    actual[1, 1, 2] += 1e-4  # allowed 1e-5 + 2e-5: outside by 3.3x, the worst
    actual[2, 0, 3] = 1.5e-5  # allowed 1e-5: outside by 1.5x
    c = compare(actual, expected, FP32, FP32, ("token", "head", "channel"))
    assert not c.passed
    assert c.measurement.n_outside == 2 and c.measurement.share_outside == pytest.approx(2 / 24)
    assert c.measurement.max_abs == pytest.approx(1e-4, rel=1e-3)
    assert c.measurement.margin == pytest.approx(1e-4 / 3e-5, rel=1e-3)
    assert c.measurement.worst["index"] == {"token": 1, "head": 1, "channel": 2}
    assert c.measurement.nrmse == pytest.approx(math.hypot(1e-4, 1.5e-5) / 2.0, rel=1e-3)
    assert (
        "2 of 24 elements (8.3%) outside 1e-05 + 1e-05*|ref|; worst at token 1, head 1, channel 2"
        in summary(c)
    )


def test_holds_inside_the_limit_and_reports_the_rfc_verdict_beside() -> None:
    expected = np.linspace(-2, 2, 1000, dtype=np.float32)
    actual = expected + 5e-3 * np.sign(expected)  # well inside 1e-2 + 1e-2|b|, outside the RFC's 1e-3
    c = compare(actual, expected, BF16, RFC_BF16)
    assert c.passed and c.measurement.margin < 1
    assert c.measurement.nrmse < 5e-3
    assert (
        not c.measurement.rfc["passed"]
        and c.measurement.rfc["share_outside"] > 0.5
        and c.measurement.rfc["margin"] > 1
    )


def test_normalised_rmse_gate() -> None:
    expected = np.ones(100, np.float32)
    actual = expected + 9e-3  # element-wise inside 1e-2 + 1e-2, but an RMSE of 9e-3 > 5e-3
    c = compare(actual, expected, BF16, RFC_BF16)
    assert not c.passed and c.measurement.margin < 1
    assert c.gate_ratio == pytest.approx(9e-3 / 5e-3, rel=1e-3)
    assert "normalised RMSE 0.009 > 0.005" in summary(c)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_fails(bad: float) -> None:
    expected = np.ones((4, 4), np.float32)
    actual = expected.copy()
    actual[2, 3] = bad
    c = compare(actual, expected, BF16, RFC_BF16, ("token", "channel"))
    assert not c.passed
    assert "1 NaN/Inf value(s) in the result" in summary(c)
    assert c.measurement.worst["index"] == {"token": 2, "channel": 3}


def test_shape_mismatch_fails_with_both_shapes() -> None:
    c = compare(np.zeros((3, 4)), np.zeros((4, 4)), FP32, FP32)
    assert not c.passed and "result has shape (3, 4), the reference (4, 4)" in summary(c)


def test_positions_map_selected_rows_back() -> None:
    c = compare(
        np.array([[0.0], [1.0]]),
        np.zeros((2, 1)),
        FP32,
        FP32,
        ("token", "channel"),
        {"token": np.array([7, 42])},
    )
    assert c.measurement.worst["index"] == {"token": 42, "channel": 0}


def test_policy_file_and_overrides(tmp_path: Path) -> None:
    policy = TolerancePolicy.load()
    assert policy.tolerance("layer", "fp32") == Tolerance(1e-5, 1e-5)
    assert policy.tolerance("layer", "bf16").max_nrmse == 5e-3
    assert policy.rfc["bf16"] == Tolerance(1e-3, 1e-3)
    text = (
        Path(policy.source).read_text()
        + '\n[[override]]\ncheck = "kernel-*-state"\ndtype = "fp32"\natol = 3e-5\nreason = "measured"\n'
    )
    (tmp_path / "t.toml").write_text(text)
    custom = TolerancePolicy.load(tmp_path / "t.toml")
    assert custom.tolerance("kernel-chunk-state", "fp32") == Tolerance(3e-5, 1e-5, reason="measured")
    assert custom.tolerance("kernel-chunk-state", "bf16") == policy.gate["bf16"]
    (tmp_path / "t.toml").write_text(text.replace('reason = "measured"', ""))
    with pytest.raises(
        ValueError, match=r"override\[\d+\] \('kernel-\*-state'\): an override needs a written 'reason'"
    ):
        TolerancePolicy.load(tmp_path / "t.toml")
    (tmp_path / "t.toml").write_text(text.replace("atol = 3e-5", "atol = -1"))
    with pytest.raises(ValueError, match="tolerance atol must be a finite number >= 0, got -1"):
        TolerancePolicy.load(tmp_path / "t.toml")
