"""The rounding budget of a stage's widest fp32 reduction: what raises the fp32 relative gate's floors.

A K-term fp32 dot product has, whatever order it sums in, an error of order `sqrt(K) · u` relative to
its result (u = 2^-24; the probabilistic bound of Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), and
which order a faithful implementation takes is its own: XLA, a BLAS and torch sum a 2304-long dot
differently. So the relative gate's floors of an fp32 stage carry the budget of the widest reduction
that produces it (docs/tolerance-policy.md, "The rounding budget of a reduction"):

    nRMSE floor  = max(nrmse_floor,  nrmse_lambda  · sqrt(K) · u)
    margin floor = max(margin_floor, margin_lambda · sqrt(K) · u · max_e s_e / (atol + rtol·|t_e|))

with `s_e` the RMS of the truth over the element's head (over the whole result where it has no head
axis): the budget at the tail of the error's distribution, in units of the element's limit. Which K a
stage has is the check catalogue's (`conformance.checks.reductions`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from conformance.judging.limits import RelativeLimits, Tolerance

FP32_UNIT_ROUNDOFF = 2.0**-24


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The widest fp32 reduction behind a stage: its length K and, in words, what it is."""

    length: int
    stage: str

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"a reduction's length must be >= 1, got {self.length} ({self.stage})")

    @property
    def budget(self) -> float:
        """`sqrt(K) · u`: the relative RMS error of one K-term fp32 dot."""
        return math.sqrt(self.length) * FP32_UNIT_ROUNDOFF


def head_scale(truth: np.ndarray, head_axis: int | None) -> np.ndarray:
    """The RMS of `truth` over each head (every axis but `head_axis`), broadcastable against it; over the
    whole array when `head_axis` is None."""
    t = np.asarray(truth, np.float64)
    axes = tuple(axis for axis in range(t.ndim) if axis != head_axis) if head_axis is not None else None
    return np.sqrt(np.mean(t * t, axis=axes, keepdims=True))


def reduction_limits(
    limits: RelativeLimits,
    reduction: Reduction | None,
    truth: np.ndarray,
    tolerance: Tolerance,
    head_axis: int | None,
) -> RelativeLimits:
    """`limits` with its floors raised to the rounding budget of `reduction` on this `truth` (module
    docstring), recorded in `limits.reduction`; `limits` itself when the policy sets no lambda (bf16) or
    the stage has no reduction."""
    if reduction is None or not (limits.nrmse_lambda or limits.margin_lambda):
        return limits
    t = np.asarray(truth, np.float64)
    scale = np.broadcast_to(head_scale(t, head_axis), t.shape)
    scale_over_limit = float(np.max(scale / (tolerance.atol + tolerance.rtol * np.abs(t)), initial=0.0))
    nrmse = limits.nrmse_lambda * reduction.budget
    margin = limits.margin_lambda * reduction.budget * scale_over_limit
    return dataclasses.replace(
        limits,
        nrmse_floor=max(limits.nrmse_floor, nrmse),
        margin_floor=max(limits.margin_floor, margin),
        reduction=ReductionFloors(reduction.length, reduction.stage, nrmse, margin, scale_over_limit),
    )


@dataclasses.dataclass(frozen=True)
class ReductionFloors:
    """What a stage's reduction gives its floors: K, the stage, the nRMSE and margin floors of its
    budget (each applies where above the policy's), and the largest head scale over an element's limit."""

    length: int
    stage: str
    nrmse_floor: float
    margin_floor: float
    scale_over_limit: float

    def source(self, statistic: str) -> str:
        """Where a floor of `statistic` ("margin" or "nRMSE") comes from, for its criterion's record."""
        return f"rounding budget of a {self.length}-long fp32 reduction ({self.stage}), {statistic}"
