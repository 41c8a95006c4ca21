"""The limits a check is held to: the element-wise tolerance (`Tolerance`), the relative gate's factor
and floors (`RelativeLimits`) and the bf16 precision contract's limits (`ContractLimits`), each refusing
a value it cannot use with a ValueError that names it. Which limits each check gets is the policy's
(`conformance.policy`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conformance.judging.reduction import ReductionFloors, ReductionSpread

TOLERANCE_FIELDS = ("atol", "rtol", "max_nrmse")  # the numbers of a `Tolerance`


def finite_number(value: Any, name: str, minimum: float = 0.0, strict: bool = False) -> float:
    """`value` as a float where it is a finite number >= `minimum` (> with `strict`), else a ValueError
    naming `name`."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (finite and (value > minimum if strict else value >= minimum)):
        raise ValueError(
            f"{name} must be a finite number {'>' if strict else '>='} {minimum:g}, got {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Element-wise `|a - b| <= atol + rtol * |b|`, and `‖a - b‖₂ / ‖b‖₂ <= max_nrmse` where set (over
    what the policy's `min_tokens` rule lets it decide: `measurement.min_tokens_rule`)."""

    atol: float
    rtol: float
    max_nrmse: float | None = None
    reason: str | None = None  # why a per-check override departs from the dtype's policy

    def __post_init__(self) -> None:
        for name in TOLERANCE_FIELDS:
            if getattr(self, name) is not None:
                finite_number(getattr(self, name), f"tolerance {name}")
        if self.max_nrmse == 0:
            raise ValueError("tolerance max_nrmse must be > 0 (leave it out to gate no nRMSE)")
        if self.atol == 0 and self.rtol == 0:
            raise ValueError("tolerance atol and rtol cannot both be 0")

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


@dataclasses.dataclass(frozen=True)
class RelativeLimits:
    """The relative gate: the implementation's error against the float64 truth may be at most
    `factor` × the reference's own error against it, plus a floor: in margin (the check's
    `atol + rtol·|truth|` shape) `impl ≤ factor·ref + margin_floor`, in nRMSE
    `impl ≤ factor·ref + nrmse_floor`. The lambdas raise the floors to the rounding budget of the
    stage's widest fp32 reduction (`conformance.judging.reduction`); 0 leaves them as they are.
    `spread_lambda` > 0 holds a layer result's reference error to at least the reductions' spread: the
    error of the float64 layer whose every reduction is moved by `spread_lambda · 2^-24 · sum |a_i b_i|`,
    raised where few roundings decide the result to the `1 - spread_tail` quantile of a faithful
    pipeline's error beyond `factor` (`reduction.ReductionSpread`, computed per check into `spread`);
    0: no spread. `gradient_spread_lambda` > 0 does the same for a layer weight's gradient, from the
    gradient itself: each element moved by `gradient_spread_lambda · u · sqrt(Σ terms²)` (the terms its sum
    adds, u the run dtype's unit roundoff)."""

    factor: float
    margin_floor: float
    nrmse_floor: float
    nrmse_lambda: float = 0.0  # the nRMSE floor is at least nrmse_lambda · sqrt(K) · 2^-24
    margin_lambda: float = 0.0  # the margin floor at least margin_lambda · sqrt(K) · 2^-24 in scale units
    spread_lambda: float = 0.0  # each reduction of the spread's model moved by spread_lambda · 2^-24 · Σ|ab|
    spread_tail: float = 1e-5  # the one-sided probability a faithful result's error may exceed the spread's
    # each element of a layer weight's gradient moved by gradient_spread_lambda · u · sqrt(Σ terms²) in the
    # gradients' spread (u the run dtype's unit roundoff); 0: no spread
    gradient_spread_lambda: float = 0.0
    # The floors' reduction where they were raised to it (`reduction.reduction_limits`), else None.
    reduction: ReductionFloors | None = None
    # The reductions' spread of the check's result where it was computed (`reduction.spread_of`).
    spread: ReductionSpread | None = None

    def __post_init__(self) -> None:
        for name in (
            "factor",
            "margin_floor",
            "nrmse_floor",
            "nrmse_lambda",
            "margin_lambda",
            "spread_lambda",
            "gradient_spread_lambda",
        ):
            finite_number(getattr(self, name), name)
        if not 0 < finite_number(self.spread_tail, "spread_tail") < 0.5:
            raise ValueError(f"spread_tail must be a probability in (0, 0.5), got {self.spread_tail!r}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1 (no worse than the reference), got {self.factor!r}")
        if self.margin_floor == 0 or self.nrmse_floor == 0:
            raise ValueError("margin_floor and nrmse_floor must be > 0 (a reference may equal the truth)")

    def as_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        for name in ("reduction", "spread"):
            if getattr(self, name) is None:
                del record[name]
        if self.spread is not None:
            record["spread"] = self.spread.as_dict()
        return record


@dataclasses.dataclass(frozen=True)
class ContractLimits:
    """The bf16 precision contract: the implementation against the float64 layer that rounds to bf16
    exactly at the contract's points (docs/bf16-rounding.md). Its nRMSE against that model may be at
    most `max_nrmse` for a stage the contract stores in bf16, `max_nrmse_fp32_stage` for one it keeps in
    fp32 (g, beta, the recurrent states), and its gain (the error's component along the model,
    `<x - m, m> / <m, m>`) at most `max_gain` in size; both are whole-output statistics, under the
    policy's `min_tokens` rule (`measurement.min_tokens_rule`). A result
    `closer_factor` times closer to the float64 truth (nRMSE) than the model itself is exempt: it rounds
    less than the contract, not worse. Each limit is at least `spread_factor` × the model's own spread: how
    far the model moves when every value it rounds within an fp32 ulp of a bf16 tie rounds the other way
    (`checks.truth.flipped_contract_rounding`), which is how far a faithful implementation's one-ulp flips
    carry where the layer amplifies them."""

    max_nrmse: float
    max_nrmse_fp32_stage: float
    max_gain: float
    closer_factor: float
    spread_factor: float

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            finite_number(getattr(self, field.name), field.name, strict=True)
        if self.closer_factor < 1:
            raise ValueError(f"closer_factor must be >= 1, got {self.closer_factor!r}")

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
