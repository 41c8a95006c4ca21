"""Hypothesis drives the search: it draws cases until one is flagged or the time budget is spent, then
shrinks the flagged case to a minimal one that still fails the same check.

The draws run in batches of `BATCH` examples (`@given` with `max_examples=BATCH`), batch b seeded with
(seed, b): the whole run is a pure function of the seed, and the budget is looked at between cases.
Within a batch, the first flagged case fixes the target check (its worst flagged one); hypothesis then
shrinks it (fewer and shorter sequences, zero state, unit scale, natural gate and beta, the first weight
set and dtype: each field towards its first value, `space.case_strategy`), keeping only cases that fail
the target check. A case is judged once (`memo`): hypothesis may ask again, and the answer must not
change. Shrinking stops after `shrink_budget_s`: from then on a new case counts as passing, and the
smallest failing case found so far is the result. Hypothesis's own cap on one shrink (five minutes,
`engine.MAX_SHRINKING_SECONDS`, monkeypatchable by its documentation) is raised to `shrink_budget_s`
while the search runs, so that `shrink_budget_s` bounds the shrink: under hypothesis's cap, the shrink of
a slow implementation (sglang-jax's interpreted Pallas kernels compile each new shape: 26 cases in 423 s
on a CPU) stops at five minutes whatever the budget, at a point that depends on the machine's speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def shrinking_allowed(seconds: float) -> Iterator[None]:
    """Hypothesis's cap on the time of one shrink raised to `seconds` (never lowered), restored after."""
    before = engine.MAX_SHRINKING_SECONDS
    engine.MAX_SHRINKING_SECONDS = max(before, seconds)
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = before


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
    started = time.perf_counter()
    memo: dict[SearchCase, CaseVerdict] = {}
    drawn = 0
    state: dict[str, object] = {}

    def elapsed() -> float:
        return time.perf_counter() - started

    def probe(case: SearchCase) -> None:
        nonlocal drawn
        target = state.get("target")
        if case not in memo:
            if target is None and elapsed() > budget_s:
                return  # the budget is spent: the rest of the batch passes unjudged
            if target is not None and elapsed() - state["found_s"] > shrink_budget_s:
                return  # the shrinking's time is spent: the smallest failing case so far stands
            memo[case] = judge(case)
            drawn += target is None
            on_verdict(memo[case], target is not None)
        verdict = memo[case]
        flagged = [j.check for j in verdict.flagged]
        if target is None and flagged:
            state.update(target=flagged[0], first=case, found_s=elapsed(), before=len(memo))
            target = flagged[0]
        if target is not None and target in flagged:
            state["smallest"] = case
            raise _Flagged(target)

    batch = 0
    while elapsed() < budget_s:
        run = settings(
            max_examples=BATCH,
            database=None,
            deadline=None,
            phases=(Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            verbosity=Verbosity.quiet,
            print_blob=False,
        )(hypothesis_seed(seed * 1_000_003 + batch)(given(cases)(probe)))
        try:
            with shrinking_allowed(shrink_budget_s):
                run()
        except _Flagged:
            shrunk = state["smallest"]
            finding = Finding(
                check=state["target"],
                first=state["first"],
                case=shrunk,
                verdict=memo[shrunk],
                found_s=state["found_s"],
                shrink_s=elapsed() - state["found_s"],
                shrink_cases=len(memo) - state["before"],
            )
            return Exploration(drawn, elapsed(), finding)
        batch += 1
    return Exploration(drawn, elapsed(), None)
