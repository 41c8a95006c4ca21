"""The reductions' spread: how many roundings decide a result, the tail allowed for so few, and the spread a
check records (docs/tolerance-policy.md, "The reductions' spread")."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from conformance.judging.attribution import TruthError, relative_criteria
from conformance.judging.reduction import effective_roundings, spread_of, tail_allowance
from conformance.judging.verdict import decide
from conformance.policy import TolerancePolicy
from kda_spec.truth import summation_scale
from tests.conformance.summation_orders import lane_ordered_matmul

POLICY = TolerancePolicy.load()
FP32 = POLICY.relative["fp32"]


def test_one_rounding_deciding_every_draw_is_one_effective_rounding() -> None:
    direction = np.random.default_rng(0).standard_normal((3, 2, 8, 8))
    draws = [sign * 1e-7 * direction for sign in (1, -1, -1, 1, 1, -1, 1, 1)]
    assert effective_roundings(draws) == pytest.approx(1.0)


def test_orthogonal_roundings_of_equal_weight_count_as_many() -> None:
    rng = np.random.default_rng(1)
    basis = np.eye(4)  # four roundings, each moving its own element
    draws = [rng.choice([-1.0, 1.0], size=4) @ basis for _ in range(400)]
    assert effective_roundings(draws) == pytest.approx(4.0, rel=0.2)
    assert effective_roundings([basis[0], basis[1]]) == math.inf  # exactly orthogonal draws: no cross term


def test_effective_roundings_needs_two_draws() -> None:
    with pytest.raises(ValueError, match="at least 2 draws, got 1"):
        effective_roundings([np.ones(3)])


@pytest.mark.parametrize(
    ("roundings", "expected"),
    [
        # sqrt of the chi-square quantile at 1 - 1e-5 over the degrees of freedom, over the factor 2:
        # 1 degree: the normal quantile 4.417 (exact); 2: sqrt(23.03 / 2); 4: sqrt(28.47 / 4)
        (1.0, 4.417 / 2),
        (2.0, math.sqrt(23.03 / 2) / 2),
        (4.0, math.sqrt(28.47 / 4) / 2),
        (11.0, 1.0),
        (1000.0, 1.0),
        (math.inf, 1.0),
    ],
)
def test_the_tail_allowance_is_the_chi_quantile_beyond_the_factor(roundings: float, expected: float) -> None:
    assert tail_allowance(roundings, 2.0, 1e-5) == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("tail", [0.0, 0.5, -1e-3])
def test_a_tail_that_is_no_probability_is_refused(tail: float) -> None:
    with pytest.raises(ValueError, match="tail"):
        tail_allowance(1.0, 2.0, tail)
    with pytest.raises(ValueError, match="spread_tail"):
        dataclasses.replace(FP32, spread_tail=tail)


def test_spread_of_needs_one_margin_nrmse_and_error_per_draw() -> None:
    with pytest.raises(ValueError, match="got 2, 2 and 1"):
        spread_of([0.1, 0.2], [1e-7, 2e-7], [np.ones(3)], FP32)


def test_the_spread_is_the_rms_of_the_draws_times_its_tail() -> None:
    direction = np.random.default_rng(2).standard_normal(50)
    draws = [sign * direction for sign in (1, -1, 1, -1)]  # one rounding decides
    spread = spread_of([0.3, 0.4, 0.3, 0.4], [1e-6, 2e-6, 1e-6, 2e-6], draws, FP32)
    assert spread.rms_nrmse == pytest.approx(math.sqrt((1 + 4 + 1 + 4) / 4) * 1e-6)
    assert spread.roundings == pytest.approx(1.0)
    assert spread.tail == pytest.approx(tail_allowance(1.0, FP32.factor, FP32.spread_tail))
    assert spread.nrmse == pytest.approx(spread.rms_nrmse * spread.tail)
    record = spread.as_dict()
    assert record["nrmse"] == spread.nrmse and record["roundings"] == spread.roundings


def test_the_gate_takes_the_larger_of_the_reference_and_the_spread_and_names_the_spread() -> None:
    spread = spread_of([0.2, 0.2], [1e-6, 1e-6], [np.eye(3)[0], np.eye(3)[1]], FP32)  # many roundings
    limits = dataclasses.replace(FP32, spread=spread)
    lucky = TruthError(margin=0.01, nrmse=1e-8, max_abs=0.0)  # a reference that drew a tiny rounding
    impl = TruthError(margin=0.3, nrmse=1.5e-6, max_abs=0.0)
    assert not decide("relative", relative_criteria(impl, lucky, FP32)).passed
    criteria = relative_criteria(impl, lucky, limits)
    assert decide("relative", criteria).passed
    nrmse = next(c for c in criteria if c.statistic == "nRMSE vs truth")
    assert nrmse.reference == 1e-6 and "the reductions' spread, nRMSE" in nrmse.reference_source
    unlucky = TruthError(margin=0.3, nrmse=2e-6, max_abs=0.0)  # a reference worse than the spread
    assert (
        next(c for c in relative_criteria(impl, unlucky, limits) if c.statistic == "nRMSE vs truth").reference
        == 2e-6
    )


def test_the_default_policy_spreads_fp32_layer_results_only() -> None:
    assert FP32.spread_lambda == 0.5 and FP32.spread_tail == 1e-5
    assert POLICY.relative["bf16"].spread_lambda == 0.0


def test_the_summation_scale_is_the_partial_sums_root_mean_square() -> None:
    """K equal terms m: partial sums j·m, sum of squares m² K³/3 (to leading order); terms of zero total:
    a random walk, K² σ²/2."""
    k, m = 128, 0.25
    assert summation_scale(np.float64(k * m), np.float64(k * m * m), k) == pytest.approx(
        m * k**1.5 / math.sqrt(3)
    )
    assert summation_scale(np.float64(0.0), np.float64(k * 4.0), k) == pytest.approx(k * 2.0 / math.sqrt(2))


@pytest.mark.parametrize("offset", [0.0, 1.0])  # terms that cancel; terms that add up
def test_a_sequential_fp32_sum_errs_by_half_a_summation_scale(offset: float) -> None:
    """The spread's model: a sequential fp32 sum's RMS error over many sums is about 0.3-0.5 units of
    2^-24 · summation_scale (the policy's spread_lambda is 0.5), whether its terms cancel or not; in units
    of 2^-24 · sum |a_i b_i| the same errors differ by an order of magnitude."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2048, 128)) + offset).astype(np.float32)
    w = (np.abs(rng.standard_normal((128, 4))) / 10).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    squares = (x.astype(np.float64) ** 2) @ (w.astype(np.float64) ** 2)
    error = np.abs(lane_ordered_matmul(x, w, lanes=1).astype(np.float64) - exact)
    units = error / (2.0**-24 * summation_scale(exact, squares, 128))
    assert 0.25 < np.sqrt(np.mean(units**2)) <= FP32.spread_lambda
