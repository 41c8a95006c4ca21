"""Hypothesis drives the search: it draws cases until one is flagged or the time budget is spent, then
shrinks the flagged case to a minimal one that still fails the same check.

The draws run in batches of `BATCH` examples (`@given` with `max_examples=BATCH`), batch b seeded with
(seed, b): the whole run is a pure function of the seed, and the budget is looked at between cases.
Within a batch, the first flagged case fixes the target check (its worst flagged one); hypothesis then
shrinks it (each field towards its first value, `space.case_strategy`), keeping only cases that fail
the target check. A case is judged once (`memo`): hypothesis may ask again, and the answer must not
change. Shrinking stops after `shrink_budget_s`: from then on a new case counts as passing, and the
smallest failing case found so far is the result. Hypothesis's own cap on one shrink (five minutes,
`engine.MAX_SHRINKING_SECONDS`, monkeypatchable by its documentation) is raised to `shrink_budget_s`
(never lowered) while the search runs, so that `shrink_budget_s` bounds the shrink: under hypothesis's
cap, the shrink of a slow implementation (sglang-jax's interpreted Pallas kernels compile each new
shape: 26 cases in 423 s on a CPU) stops at five minutes whatever the budget, at a point that depends
on the machine's speed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine

from conformance.search.judge import CaseVerdict
from conformance.search.space import SearchCase

BATCH = 50
SHRINK_BUDGET_S = 300.0


class _Flagged(AssertionError):
    """The case fails the target check (what hypothesis shrinks on)."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """A flagged check and the smallest case found that fails it: `first` the case as drawn, `case` the
    shrunk one, `verdict` the shrunk case's judgement; `found_s` seconds from the start until `first`
    was judged, `shrink_s` the shrinking's seconds, `shrink_cases` the cases it judged."""

    check: str
    first: SearchCase
    case: SearchCase
    verdict: CaseVerdict
    found_s: float
    shrink_s: float
    shrink_cases: int


@dataclasses.dataclass(frozen=True)
class Exploration:
    """What a search did: `cases` drawn and judged (not counting the shrinking's), `seconds` in all."""

    cases: int
    seconds: float
    finding: Finding | None

    @property
    def drawing_s(self) -> float:
        """The seconds spent drawing and judging, before any shrinking."""
        return self.seconds if self.finding is None else self.finding.found_s


@dataclasses.dataclass
class Budget:
    """A search's clock: `budget_s` to draw in, then, from the first failure (`found`), `shrink_budget_s`
    to shrink in; `spent` when the current one is over."""

    budget_s: float
    shrink_budget_s: float
    started: float = dataclasses.field(default_factory=time.perf_counter)
    found_s: float | None = None  # seconds from the start to the first failure

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def found(self) -> None:
        if self.found_s is None:
            self.found_s = self.elapsed()

    def spent(self) -> bool:
        if self.found_s is None:
            return self.elapsed() > self.budget_s
        return self.elapsed() - self.found_s > self.shrink_budget_s


def explore(
    judge: Callable[[SearchCase], CaseVerdict],
    cases: st.SearchStrategy[SearchCase],
    *,
    budget_s: float,
    seed: int,
    on_verdict: Callable[[CaseVerdict, bool], None] = lambda verdict, shrinking: None,
    shrink_budget_s: float = SHRINK_BUDGET_S,
) -> Exploration:
    """Draw from `cases` and `judge` each until one is flagged (then shrink it) or `budget_s` is spent.
    `on_verdict(verdict, shrinking)` sees every new judgement (`shrinking`: one of the shrinking's)."""
    if budget_s <= 0:
        raise ValueError(f"the budget must be positive, got {budget_s} s")
    clock = Budget(budget_s, shrink_budget_s)
    memo: dict[SearchCase, CaseVerdict] = {}
    drawn = 0
    target: dict[str, Any] = {}  # once a case is flagged: its check, that case, the smallest failing one

    def probe(case: SearchCase) -> None:
        nonlocal drawn
        if case not in memo:
            if clock.spent():
                return  # passes unjudged: the rest of a batch past the budget, or a case past the shrinking's
            memo[case] = judge(case)
            drawn += not target
            on_verdict(memo[case], bool(target))
        flagged = [j.check for j in memo[case].flagged]
        if flagged and not target:
            clock.found()
            target.update(check=flagged[0], first=case, before=len(memo))
        if target and target["check"] in flagged:
            target["smallest"] = case
            raise _Flagged(target["check"])

    run_settings = settings(
        max_examples=BATCH,
        database=None,
        deadline=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    batch = 0
    while not clock.spent():
        try:
            cap = max(engine.MAX_SHRINKING_SECONDS, shrink_budget_s)  # module docstring
            with mock.patch.object(engine, "MAX_SHRINKING_SECONDS", cap):
                run_settings(hypothesis_seed(seed * 1_000_003 + batch)(given(cases)(probe)))()
        except _Flagged:
            shrunk, found_s, seconds = target["smallest"], clock.found_s, clock.elapsed()
            assert found_s is not None
            finding = Finding(
                check=target["check"], first=target["first"], case=shrunk, verdict=memo[shrunk],
                found_s=found_s, shrink_s=seconds - found_s, shrink_cases=len(memo) - target["before"],
            )  # fmt: skip
            return Exploration(drawn, seconds, finding)
        batch += 1
    return Exploration(drawn, clock.elapsed(), None)
