"""Both sides of a check against the float64 truth: their errors, who the difference between them
comes from (`Attribution.verdict`), and the relative gate's criteria (docs/tolerance-policy.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from conformance.judging.measurement import (
    elementwise_ratio,
    normalised_rmse,
)
from conformance.judging.tolerances import RelativeLimits, Tolerance
from conformance.judging.verdict import Criterion, unmet, worst_ratio

# Who a check's difference comes from, judged against the float64 truth (docs/tolerance-policy.md).
VERDICTS = ("impl", "reference", "both", "conditioning")


@dataclasses.dataclass(frozen=True)
class TruthError:
    """One side's error against the float64 truth, as a check records errors: `margin` the worst
    `|x - t| / (atol + rtol·|t|)` under the check's tolerance, `nrmse` `‖x - t‖₂ / ‖t‖₂`, `max_abs`."""

    margin: float
    nrmse: float
    max_abs: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


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
    in margin and in nRMSE; a floor raised to a reduction's rounding budget says so (`floor_source`)."""
    f, reduction = limits.factor, limits.reduction
    margin_source = nrmse_source = ""
    if reduction is not None:
        margin_source = reduction.source("margin") if reduction.margin_floor >= limits.margin_floor else ""
        nrmse_source = reduction.source("nRMSE") if reduction.nrmse_floor >= limits.nrmse_floor else ""
    return (
        Criterion(
            "relative",
            "margin vs truth",
            side.margin,
            limits.margin_floor,
            f,
            other.margin,
            floor_source=margin_source,
        ),
        Criterion(
            "relative",
            "nRMSE vs truth",
            side.nrmse,
            limits.nrmse_floor,
            f,
            other.nrmse,
            floor_source=nrmse_source,
        ),
    )


def excess(side: TruthError, other: TruthError, limits: RelativeLimits) -> list[str]:
    """Why `side` is further from the truth than `limits` allow against `other`; empty when it is not."""
    return unmet(relative_criteria(side, other, limits))


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The implementation's and the reference's own errors against the float64 truth of a check."""

    source: str  # where the truth comes from: a dump key, or the float64 recurrence
    impl: TruthError
    reference: TruthError
    limits: RelativeLimits
    apart: bool  # the two sides are out of the check's element-wise tolerance of each other

    @property
    def relative_criteria(self) -> tuple[Criterion, ...]:
        """The relative gate: the implementation no further from the truth than the reference allows."""
        return relative_criteria(self.impl, self.reference, self.limits)

    @property
    def relative_failures(self) -> list[str]:
        """Why the implementation is further from the truth than the relative gate allows."""
        return unmet(self.relative_criteria)

    @property
    def relative_ratio(self) -> float:
        """The implementation's error as a share of what the relative gate allows (<= 1 holds)."""
        return worst_ratio(self.relative_criteria)

    @property
    def verdict(self) -> str:
        """`impl` / `reference`: that side is clearly further from the truth than the other (beyond the
        relative gate's factor and floor, either way round); `both`: each is, on a different measure,
        or neither is while the two sides are out of tolerance of each other and each is out of the
        check's tolerance of the truth; `conditioning`: neither is, and at least one side is within
        the check's tolerance of the truth (or the sides agree): equally good results, whose
        difference is what the computation's conditioning makes of their roundings."""
        impl_worse = bool(self.relative_failures)
        reference_worse = bool(excess(self.reference, self.impl, self.limits))
        if impl_worse and reference_worse:
            return "both"
        if impl_worse or reference_worse:
            return "impl" if impl_worse else "reference"
        both_off = min(self.impl.margin, self.reference.margin) > 1
        return "both" if self.apart and both_off else "conditioning"

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": True,
            "source": self.source,
            "impl": self.impl.as_dict(),
            "reference": self.reference.as_dict(),
            "limits": self.limits.as_dict(),
            "apart": self.apart,
            "verdict": self.verdict,
            "relative_ratio": self.relative_ratio,
            "relative_failures": self.relative_failures,
        }


def attribute(
    actual: np.ndarray,
    expected: np.ndarray,
    truth: np.ndarray,
    source: str,
    tolerance: Tolerance,
    limits: RelativeLimits,
    apart: bool,
) -> Attribution:
    """Both sides of a check against its float64 truth; `apart`: whether the check's absolute
    comparison of the two sides failed."""
    return Attribution(
        source=source,
        impl=error_vs_truth(actual, truth, tolerance),
        reference=error_vs_truth(expected, truth, tolerance),
        limits=limits,
        apart=apart,
    )
