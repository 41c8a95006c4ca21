"""The fp32 relative gate's floors carry the rounding budget of the stage's widest reduction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.checks import kinds
from conformance.checks.kinds import parse_check
from conformance.checks.reductions import REFERENCE_CHUNK_TOKENS, reduction_of
from conformance.judging.attribution import error_vs_truth, relative_criteria
from conformance.judging.reduction import FP32_UNIT_ROUNDOFF, Reduction, head_scale, reduction_limits
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import criterion_from_record, criterion_record
from kda_spec.config import get_preset

POLICY = TolerancePolicy.load()
REAL = get_preset("kimi-linear-48b-a3b")


@pytest.mark.parametrize(
    ("check", "length"),
    [
        ("q_after_conv", 2304),
        ("beta", 2304),
        ("o_norm", 2304),
        ("layer-state", 2304),
        ("layer", 4096),
        ("decode-k8-self", 4096),
        ("chunked-prefill", 4096),
        ("layer-positions", 4096),
        ("serving-mixed-extend", 4096),
        ("serving-mixed-extend-state", 2304),
        ("kernel-chunk", max(128, REFERENCE_CHUNK_TOKENS)),
        ("layer-kernel-state", max(128, REFERENCE_CHUNK_TOKENS)),
        ("serving-prefix-hit-checkpoint", 2304),
        ("kernel-recurrent-state", 128),
    ],
)
def test_each_check_has_the_k_of_its_widest_reduction(check: str, length: int) -> None:
    assert reduction_of(parse_check(check).kind, REAL).length == length


def test_the_nrmse_floor_is_sqrt_k_ulps_and_never_below_the_policy() -> None:
    truth = np.random.default_rng(0).standard_normal((64, 4, 32))
    tolerance = POLICY.tolerance("q_after_conv", "fp32")
    wide = reduction_limits(POLICY.relative["fp32"], Reduction(2304, "x"), truth, tolerance, 1)
    assert wide.nrmse_floor == pytest.approx(math.sqrt(2304) * FP32_UNIT_ROUNDOFF)  # 2.9e-6
    narrow = reduction_limits(POLICY.relative["fp32"], Reduction(1, "x"), truth, tolerance, 1)
    assert narrow.nrmse_floor == POLICY.relative["fp32"].nrmse_floor  # sqrt(1)·u < 2e-7
    assert narrow.margin_floor == POLICY.relative["fp32"].margin_floor


def test_the_margin_floor_is_the_budget_in_units_of_the_limit() -> None:
    truth = np.zeros((8, 2, 4))
    truth[:, 0] = 100.0  # a head of large values; the other head's RMS is 0
    tolerance = POLICY.tolerance("q_after_conv", "fp32")
    limits = POLICY.relative["fp32"]
    raised = reduction_limits(limits, Reduction(2304, "x"), truth, tolerance, 1)
    budget = math.sqrt(2304) * FP32_UNIT_ROUNDOFF
    expected = limits.margin_lambda * budget * 100.0 / (tolerance.atol + tolerance.rtol * 100.0)
    assert raised.margin_floor == pytest.approx(max(limits.margin_floor, expected))
    assert raised.reduction is not None and raised.reduction.length == 2304
    np.testing.assert_allclose(head_scale(truth, 1)[0, :, 0], [100.0, 0.0])


def test_bf16_floors_stay_as_the_policy_sets_them() -> None:
    truth = np.ones((8, 2, 4))
    limits = POLICY.relative["bf16"]
    assert (
        reduction_limits(limits, Reduction(4096, "x"), truth, POLICY.tolerance("layer", "bf16"), 1) is limits
    )


def test_a_raised_floor_says_where_it_comes_from_and_survives_the_report() -> None:
    truth = np.random.default_rng(1).standard_normal((64, 4096))
    tolerance = POLICY.tolerance("layer", "fp32")
    layer = reduction_of(kinds.LAYER, REAL)
    limits = reduction_limits(POLICY.relative["fp32"], layer, truth, tolerance, None)
    side = error_vs_truth(truth + 1e-6, truth, tolerance)
    _, nrmse = relative_criteria(side, side, limits)
    assert "4096-long fp32 reduction" in nrmse.floor_source
    assert nrmse.floor == pytest.approx(math.sqrt(4096) * FP32_UNIT_ROUNDOFF)
    rebuilt = criterion_from_record(criterion_record(nrmse), "test")
    assert rebuilt == nrmse
    assert limits.as_dict()["reduction"]["length"] == 4096


def test_the_floor_turns_a_3x_worse_summation_green_at_real_size_and_still_fails_a_defect() -> None:
    """The issue's real-size numbers: conv outputs at nRMSE 8.3e-7 against the reference's 2.8e-7 fail
    the old floor (2×2.8e-7 + 2e-7) and hold under K = 2304's; a defect 10x the budget still fails."""
    truth = np.random.default_rng(2).standard_normal((256, 32, 128))
    tolerance = POLICY.tolerance("q_after_conv", "fp32")
    limits = reduction_limits(
        POLICY.relative["fp32"], reduction_of(kinds.INTERMEDIATE, REAL), truth, tolerance, 1
    )
    bound = limits.factor * 2.8e-7 + limits.nrmse_floor
    assert 2 * 2.8e-7 + 2e-7 < 8.3e-7 < bound
    assert 10 * math.sqrt(2304) * FP32_UNIT_ROUNDOFF > bound
