"""What a search tried and found: running tallies, the progress bar, the terminal tables, `search.json`."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conformance.search.judge import CHECKS, HEADROOM, CaseVerdict
from conformance.search.space import regimes

REPORT_FILE = "search.json"


@dataclasses.dataclass
class Tally:
    """Running counts over the judged cases (the shrinking's counted apart); `worst`: check (those of
    `checks`) → the largest ratio it reached and the case it was on."""

    checks: tuple[str, ...] = CHECKS
    cases: int = 0
    shrink_cases: int = 0
    flagged_cases: int = 0
    case_seconds: float = 0.0
    per_regime: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    worst: dict[str, tuple[float, str]] = dataclasses.field(init=False)
    judged: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self.worst = dict.fromkeys(self.checks, (0.0, ""))

    def add(self, verdict: CaseVerdict, shrinking: bool) -> None:
        if shrinking:
            self.shrink_cases += 1
            return
        self.cases += 1
        self.case_seconds += verdict.seconds
        self.flagged_cases += bool(verdict.flagged)
        self.per_regime.update(regimes(verdict.case, verdict.config))
        for check, judgement in verdict.checks.items():
            self.judged[check] += 1
            if not judgement.ratio <= self.worst[check][0]:  # NaN and inf count as the worst
                self.worst[check] = (judgement.ratio, verdict.case.describe())
        self.skipped.update(verdict.skipped.keys())

    @property
    def worst_ratio(self) -> float:
        return max((ratio for ratio, _ in self.worst.values()), default=0.0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "shrink_cases": self.shrink_cases,
            "flagged_cases": self.flagged_cases,
            "seconds_per_case": self.case_seconds / self.cases if self.cases else None,
            "per_regime": dict(sorted(self.per_regime.items())),
            "per_check": {
                check: {
                    "judged": self.judged[check],
                    "skipped": self.skipped[check],
                    "worst_ratio": ratio,
                    "worst_case": case,
                }
                for check, (ratio, case) in self.worst.items()
            },
        }


class SearchProgress(Progress):
    """A progress bar over the time budget, with the cases judged and the worst ratio so far; nothing
    shown when `enabled` is False."""

    def __init__(self, budget_s: float, console: Console, *, enabled: bool):
        super().__init__(
            TextColumn("[bold]search[/]"),
            BarColumn(),
            TextColumn("{task.fields[cases]} cases, worst ratio {task.fields[worst]}, {task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
        )
        self.budget_s, self.started = budget_s, time.perf_counter()
        self.task = self.add_task("search", total=budget_s, cases=0, worst="-", status="searching")

    def show(self, tally: Tally, shrinking: bool) -> None:
        self.update(
            self.task,
            completed=min(time.perf_counter() - self.started, self.budget_s),
            cases=tally.cases,
            worst=f"{tally.worst_ratio:.3g}",
            status=f"shrinking ({tally.shrink_cases} tried)" if shrinking else "searching",
        )


def regime_table(tally: Tally) -> Table:
    table = Table(title="cases per regime (a case counts under each of its regimes)")
    table.add_column("regime")
    table.add_column("cases", justify="right")
    for regime, count in sorted(tally.per_regime.items()):
        table.add_row(regime, str(count))
    return table


def check_table(tally: Tally) -> Table:
    title = (
        "worst relative ratio per check: impl vs truth over the relative gate's limit (a bit-exact check: 0 "
        "or inf)"
    )
    table = Table(title=f"{title}; flagged above {HEADROOM:g}")
    table.add_column("check", no_wrap=True)
    for column in ("judged", "skipped", "worst ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("on the case", no_wrap=True)
    for check, (ratio, case) in tally.worst.items():
        shown = f"{ratio:.3g}" if tally.judged[check] else "-"
        style = "bold red" if not ratio <= HEADROOM else None
        table.add_row(check, str(tally.judged[check]), str(tally.skipped[check]), shown, case, style=style)
    return table
