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

That budget is relative to a dot's result, as it is where the terms do not cancel. Where they do, a
dot's rounding is relative to `sum |a_i b_i|`, not to the result, and where the layer then amplifies it
(a final state that strong decay leaves as the last token's update, its beta's logit 0.19 from terms of
sum 631), the reference's own error is one draw of that one dot's rounding: lucky on one machine, not on
another. So a layer result's reference error is also held to at least the **reductions' spread**
(docs/tolerance-policy.md, "The reductions' spread"): the float64 layer with every reduction's result
moved by `spread_lambda · u · sum |a_i b_i|` with a random sign
(`conformance.checks.truth.computed_reduction_spread`), its error against the truth, the root mean square
over its draws; where few roundings decide the result (`effective_roundings` of the draws), that root
mean square is raised to the tail of a chi distribution with as many degrees of freedom
(`tail_allowance`), beyond what the relative gate's factor already allows (`spread_of`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import scipy.stats

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


@dataclasses.dataclass(frozen=True)
class ReductionSpread:
    """A check's reductions' spread (module docstring): the root mean square over `draws` float64 layers,
    each with its reductions moved by `spread_lambda · u · sum |a_i b_i|`, of their margin and nRMSE
    against the truth (`rms_margin`, `rms_nrmse`); `roundings`, how many independent roundings decide the
    result (`effective_roundings`), and `tail`, the allowance for so few (`tail_allowance`). The relative
    gate holds the reference's error to at least `margin` and `nrmse`: the root mean squares times `tail`."""

    rms_margin: float
    rms_nrmse: float
    draws: int
    spread_lambda: float
    roundings: float
    tail: float
    # what each draw moved, for the record (`source`)
    model: str = "float64 layer, every reduction moved by {lambda}·2^-24·Σ|ab|"

    @property
    def margin(self) -> float:
        return self.rms_margin * self.tail

    @property
    def nrmse(self) -> float:
        return self.rms_nrmse * self.tail

    def source(self, statistic: str) -> str:
        """What a criterion's reference is where it is this spread (`statistic`: "margin" or "nRMSE")."""
        tail = f", x{self.tail:.3g} for {self.roundings:.3g} effective roundings" if self.tail > 1 else ""
        model = self.model.replace("{lambda}", f"{self.spread_lambda:g}")
        return f"the reductions' spread, {statistic} ({model}, RMS of {self.draws} draws{tail})"

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "margin": self.margin, "nrmse": self.nrmse}


def effective_roundings(
    errors: Sequence[np.ndarray],  # one per draw, each [...] the draw's result minus the truth
) -> float:
    """How many independent roundings decide a result, from its spread's draws (each every reduction moved
    by the same size with independent random signs): the participation ratio `tr(C)^2 / tr(C^2)` of the
    draws' covariance C, estimated as `mean_d |E_d|^2` squared over `mean_{d≠d'} (E_d · E_d')^2`. 1 where
    one reduction decides (every draw the same vector up to its sign), as many as there are where they
    weigh alike and are orthogonal; inf where the draws are exactly orthogonal or all zero."""
    if len(errors) < 2:
        raise ValueError(f"effective_roundings needs at least 2 draws, got {len(errors)}")
    e = np.stack([np.asarray(error, np.float64).ravel() for error in errors])
    gram = e @ e.T
    pairs = gram[np.triu_indices(len(errors), k=1)]
    cross = float(np.mean(pairs * pairs))
    if cross == 0.0:
        return math.inf
    return max(1.0, float(np.mean(np.diag(gram))) ** 2 / cross)


def tail_allowance(roundings: float, factor: float, tail_probability: float) -> float:
    """The spread's multiplier for a result of `roundings` effective roundings: a faithful pipeline's error
    is then its root mean square times chi with `roundings` degrees of freedom over sqrt(`roundings`);
    the gate allows `factor` times the reference, so the spread is raised by what the `1 -
    tail_probability` quantile of that ratio needs beyond `factor`: `max(1, q / factor)`. At factor 2 and
    a tail of 1e-5: 2.21 at 1 rounding, 1.70 at 2, 1.33 at 4, 1.0 from 11 roundings on."""
    if not 0.0 < tail_probability < 0.5:
        raise ValueError(f"tail_probability must be in (0, 0.5), got {tail_probability!r}")
    if math.isinf(roundings):
        return 1.0
    quantile = math.sqrt(float(scipy.stats.chi2.isf(tail_probability, roundings)) / roundings)
    return max(1.0, quantile / factor)


def spread_of(
    margins: Sequence[float],  # each draw's margin against the truth, under the check's tolerance
    nrmses: Sequence[float],  # each draw's nRMSE against the truth
    errors: Sequence[np.ndarray],  # each draw's result minus the truth, at the check's rows
    limits: RelativeLimits,
    gradient: bool = False,
) -> ReductionSpread:
    """The reductions' spread of a check from its draws (module docstring), under `limits`' factor,
    `spread_lambda` and `spread_tail`; with `gradient`, a layer weight gradient's (`gradient_spread_lambda`,
    `GRADIENT_SPREAD_MODEL`)."""
    if not margins or not len(margins) == len(nrmses) == len(errors):
        raise ValueError(
            f"a spread needs one margin, nRMSE and error per draw, got {len(margins)}, {len(nrmses)} "
            f"and {len(errors)}"
        )

    def rms(values: Sequence[float]) -> float:
        return float(np.sqrt(np.mean(np.square(values))))

    roundings = effective_roundings(errors)
    tail = tail_allowance(roundings, limits.factor, limits.spread_tail)
    if gradient:
        return ReductionSpread(
            rms(margins), rms(nrmses), len(margins), limits.gradient_spread_lambda, roundings, tail,
            GRADIENT_SPREAD_MODEL,
        )  # fmt: skip
    return ReductionSpread(rms(margins), rms(nrmses), len(margins), limits.spread_lambda, roundings, tail)


# What a layer weight gradient's spread moves (`conformance.checks.runner`, `gradient_spread`).
GRADIENT_SPREAD_MODEL = "float64 gradient, every element moved by {lambda}·u·sqrt(Σ terms²) of its sum"
