"""The verdict engine: every pass/fail of the project is decided here, from criteria.

A **criterion** is one statistic and its bound: `value <= factor · reference + floor` — a fixed limit
(the absolute gate: factor 0), or a multiple of the reference's own number plus a floor (the relative
gate: the implementation's error against the float64 truth against the reference's). It applies from
`min_tokens` tokens of the result on, and not where its `unless` criterion holds (the precision
contract's exemption of a result closer to the truth than the contract's model); `floor_source` says
where a floor comes from when it is not the policy's number alone (a reduction's rounding budget), and
`reference_source` what the reference number is when it is not the reference's own error (the
reductions' spread).

A check records all its criteria, grouped by gate (`absolute`, `relative`, `contract`, and `finite`:
no NaN or Inf, which decides every check); its gate mode says which gates decide (`MODE_GATES`), and
`judged_by` which of those it has criteria for. The suite, `gate` (from a report's recorded criteria),
`diff`, `power`, `search` and the long cases' windows all decide with `decide`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

# `finite` (no NaN or Inf in the result) decides every check, whatever its mode.
GATES = ("finite", "absolute", "relative", "contract")
# Which gates decide a check in each gate mode (tolerances.toml's `[[mode]]` rules).
MODE_GATES: dict[str, tuple[str, ...]] = {
    "absolute": ("absolute",),
    "relative": ("relative",),
    "absolute+relative": ("absolute", "relative"),
    "relative+contract": ("relative", "contract"),
}
# The gate mode in which the bf16 precision contract decides beside the relative gate.
CONTRACT_MODE = "relative+contract"
# What a failure of each gate's criteria is prefixed with.
_FAILURE_PREFIX = {
    "finite": "",
    "absolute": "",
    "relative": "relative to the reference: ",
    "contract": "precision contract: ",
}


@dataclasses.dataclass(frozen=True)
class Criterion:
    """`value <= factor · reference + floor`, from `min_tokens` of the result's `tokens` on, and not where
    `unless` holds. `gate` is the gate it belongs to, `statistic` what `value` is, in words; `detail`,
    where given, what a failure says instead of the numbers alone (where the worst element is)."""

    gate: str
    statistic: str
    value: float
    floor: float
    factor: float = 0.0
    reference: float = 0.0
    tokens: int = 0
    min_tokens: int = 0
    unless: Criterion | None = None
    detail: str = ""
    floor_source: str = ""  # where the floor comes from, where not the policy's number alone
    reference_source: str = ""  # what `reference` is, where not the reference's own error (a spread)

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"criterion {self.statistic!r}: gate must be one of {GATES}, got {self.gate!r}")
        for name in ("factor", "floor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"criterion {self.statistic!r}: {name} must be a finite number >= 0, got {value}"
                )
        if not self.reference >= 0:  # a reference's error; inf is a bound nothing exceeds, NaN none holds
            raise ValueError(f"criterion {self.statistic!r}: reference must be >= 0, got {self.reference}")

    @property
    def bound(self) -> float:
        return self.factor * self.reference + self.floor if self.factor else self.floor

    @property
    def applies(self) -> bool:
        return self.tokens >= self.min_tokens and not (self.unless is not None and self.unless.holds)

    @property
    def holds(self) -> bool:
        """Within its bound (NaN never is), or not applying."""
        return not self.applies or self.value <= self.bound

    @property
    def ratio(self) -> float:
        """`value` as a share of its bound (<= 1 holds); 0 where it does not apply."""
        if not self.applies:
            return 0.0
        if self.bound > 0:
            return self.value / self.bound
        return 0.0 if self.value == 0 else math.inf

    def why_not_applied(self) -> str | None:
        if self.tokens < self.min_tokens:
            return f"not gated: {self.tokens} tokens < {self.min_tokens}"
        if self.unless is not None and self.unless.holds:
            return f"exempt: {self.unless.statistic}"
        return None

    def statement(self) -> str:
        """`<statistic> <value> > <bound>`, the numbers of a failure."""
        spread = " (the reductions' spread)" if self.reference_source else ""
        bound = (
            f"{self.factor:g}×{self.reference:.3g}{spread} + {self.floor:g}"
            if self.factor
            else f"{self.floor:g}"
        )
        return f"{self.statistic} {self.value:.3g} > {bound}"

    def failure(self) -> str:
        """What the criterion says when it does not hold: its detail, or `statement`, after its gate."""
        return _FAILURE_PREFIX[self.gate] + (self.detail or self.statement())


def judged_by(mode: str, criteria: Iterable[Criterion]) -> str:
    """The gates that decide a check of gate `mode`, as a mode name: the mode's own, less the gates it
    has no criteria for — without a truth (no relative criterion) the absolute gate decides alone; a
    contract mode without the contract's model is the relative gate alone."""
    if mode not in MODE_GATES:
        raise ValueError(f"gate mode must be one of {list(MODE_GATES)}, got {mode!r}")
    present = {criterion.gate for criterion in criteria}
    wanted = MODE_GATES[mode]
    gates = tuple(gate for gate in wanted if gate in present)
    if ("relative" in wanted and "relative" not in present) or not gates:
        return "absolute"
    return next(name for name, mode_gates in MODE_GATES.items() if mode_gates == gates)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A check decided: the gates that decide it (`judged_by`) over all its `criteria`. Asked for some
    `gates`, `failures`, `holds` and `ratio` speak of those gates' criteria, deciding or not."""

    judged_by: str
    criteria: tuple[Criterion, ...]

    def of(self, *gates: str) -> tuple[Criterion, ...]:
        """The criteria of `gates`; the deciding ones (`finite` and `judged_by`'s) when none is given."""
        chosen = gates or ("finite", *MODE_GATES[self.judged_by])
        return tuple(criterion for criterion in self.criteria if criterion.gate in chosen)

    @property
    def deciding(self) -> tuple[Criterion, ...]:
        return self.of()

    @property
    def passed(self) -> bool:
        return self.holds()

    def holds(self, *gates: str) -> bool:
        return all(criterion.holds for criterion in self.of(*gates))

    def failures(self, *gates: str) -> list[str]:
        """What each criterion of `gates` (the deciding ones by default) that does not hold says."""
        return [criterion.failure() for criterion in self.of(*gates) if not criterion.holds]

    def ratio(self, *gates: str) -> float:
        """The largest criterion of `gates` (the deciding ones by default) as a share of its bound."""
        return worst_ratio(self.of(*gates))


def unmet(criteria: Iterable[Criterion]) -> list[str]:
    """What each of `criteria` that does not hold says (its detail, or `statement`), without its gate."""
    return [criterion.detail or criterion.statement() for criterion in criteria if not criterion.holds]


def worst_ratio(criteria: Iterable[Criterion]) -> float:
    """The largest of `criteria` as a share of its bound (<= 1: all hold); NaN if any is NaN, 0 for none."""
    ratios = [criterion.ratio for criterion in criteria]
    if any(math.isnan(ratio) for ratio in ratios):
        return math.nan
    return max(ratios, default=0.0)


def decide(mode: str, criteria: Iterable[Criterion]) -> Verdict:
    """The verdict of a check of gate `mode` with these criteria."""
    criteria = tuple(criteria)
    return Verdict(judged_by(mode, criteria), criteria)
