"""Both sides of a check against the float64 truth: their errors, the relative gate's criteria
(docs/tolerance-policy.md), and who the difference between them comes from (`Attribution.blame`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from conformance.judging.limits import RelativeLimits, Tolerance
from conformance.judging.measurement import elementwise_ratio, normalised_rmse
from conformance.judging.verdict import Criterion

# Who a check's difference comes from, judged against the float64 truth (docs/tolerance-policy.md).
BLAMES = ("impl", "reference", "both", "conditioning")


@dataclasses.dataclass(frozen=True)
class TruthError:
    """One side's error against the float64 truth, as a check records errors: `margin` the worst
    `|x - t| / (atol + rtol·|t|)` under the check's tolerance, `nrmse` `‖x - t‖₂ / ‖t‖₂`, `max_abs`."""

    margin: float
    nrmse: float
    max_abs: float


def error_vs_truth(x: np.ndarray, truth: np.ndarray, tolerance: Tolerance) -> TruthError:
    """The error of `x` against `truth` (same shape); a NaN/Inf in `x` is an infinite error."""
    x, t = np.asarray(x, np.float64), np.asarray(truth, np.float64)
    if x.shape != t.shape:
        raise ValueError(f"result of shape {x.shape} against a truth of shape {t.shape}")
    error = np.where(np.isfinite(x), np.abs(x - t), np.inf)
    ratio, _ = elementwise_ratio(error, t, tolerance)
    return TruthError(margin=float(ratio.max()), nrmse=normalised_rmse(error, t), max_abs=float(error.max()))


def relative_criteria(side: TruthError, other: TruthError, limits: RelativeLimits) -> tuple[Criterion, ...]:
    """The relative gate on `side`: its error against the truth within `factor` × `other`'s plus a floor,
    in margin and in nRMSE; a floor raised to a reduction's rounding budget says so (`floor_source`), and
    so does a reference error raised to the reductions' spread (`reference_source`)."""
    reduction, spread, sources = limits.reduction, limits.spread, {}
    if reduction is not None:
        raised = {"margin": reduction.margin_floor >= limits.margin_floor,
                  "nRMSE": reduction.nrmse_floor >= limits.nrmse_floor}  # fmt: skip
        sources = {statistic: reduction.source(statistic) for statistic, up in raised.items() if up}
    references = {"margin": (other.margin, ""), "nRMSE": (other.nrmse, "")}
    if spread is not None:
        for statistic, spread_value in (("margin", spread.margin), ("nRMSE", spread.nrmse)):
            if spread_value > references[statistic][0]:
                references[statistic] = (spread_value, spread.source(statistic))
    return tuple(
        Criterion("relative", f"{statistic} vs truth", value, floor, limits.factor, references[statistic][0],
                  floor_source=sources.get(statistic, ""), reference_source=references[statistic][1])
        for statistic, value, floor in (("margin", side.margin, limits.margin_floor),
                                        ("nRMSE", side.nrmse, limits.nrmse_floor))
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The implementation's and the reference's own errors against the float64 truth of a check;
    `out_of_tolerance`: whether the two sides are out of the check's element-wise tolerance of each
    other."""

    source: str  # where the truth comes from: a dump key, or the float64 recurrence
    impl: TruthError
    reference: TruthError
    limits: RelativeLimits
    out_of_tolerance: bool

    @property
    def criteria(self) -> tuple[Criterion, ...]:
        """The relative gate: the implementation no further from the truth than the reference allows."""
        return relative_criteria(self.impl, self.reference, self.limits)

    @property
    def blame(self) -> str:
        """`impl` / `reference`: that side is clearly further from the truth than the other (beyond the
        relative gate's factor and floor, either way round); `both`: each is, on a different measure,
        or neither is while the two sides are out of tolerance of each other and each is out of the
        check's tolerance of the truth; `conditioning`: neither is, and at least one side is within
        the check's tolerance of the truth (or the sides agree): equally good results, whose
        difference is what the computation's conditioning makes of their roundings."""
        impl_worse = not all(c.holds for c in self.criteria)
        reference_worse = not all(c.holds for c in relative_criteria(self.reference, self.impl, self.limits))
        if impl_worse and reference_worse:
            return "both"
        if impl_worse or reference_worse:
            return "impl" if impl_worse else "reference"
        both_off = min(self.impl.margin, self.reference.margin) > 1
        return "both" if self.out_of_tolerance and both_off else "conditioning"


def attribute(
    actual: np.ndarray,
    expected: np.ndarray,
    truth: np.ndarray,
    source: str,
    tolerance: Tolerance,
    limits: RelativeLimits,
    out_of_tolerance: bool,
) -> Attribution:
    """Both sides of a check (`actual`, `expected`: one shape) against its float64 `truth`;
    `out_of_tolerance`: whether the check's absolute comparison of the two sides failed."""
    return Attribution(
        source=source,
        impl=error_vs_truth(actual, truth, tolerance),
        reference=error_vs_truth(expected, truth, tolerance),
        limits=limits,
        out_of_tolerance=out_of_tolerance,
    )
