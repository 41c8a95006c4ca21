"""What a search tried and found: running tallies, the progress bar, the terminal tables, `search.json`."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conformance.reports.json_file import write_json
from conformance.search.judge import CHECKS, HEADROOM, CaseVerdict
from conformance.search.space import regimes

REPORT_FILE = "search.json"


@dataclasses.dataclass
class Worst:
    """The largest ratio a check reached, and on which case."""

    ratio: float = 0.0
    case: str = ""


@dataclasses.dataclass
class Tally:
    """Running counts over the judged cases (the shrinking's counted apart)."""

    cases: int = 0
    shrink_cases: int = 0
    flagged_cases: int = 0
    case_seconds: float = 0.0
    per_regime: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    worst: dict[str, Worst] = dataclasses.field(default_factory=lambda: {check: Worst() for check in CHECKS})
    judged: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, verdict: CaseVerdict, shrinking: bool) -> None:
        if shrinking:
            self.shrink_cases += 1
            return
        self.cases += 1
        self.case_seconds += verdict.seconds
        self.flagged_cases += bool(verdict.flagged)
        self.per_regime.update(regimes(verdict.case))
        for check, judgement in verdict.checks.items():
            self.judged[check] += 1
            worst = self.worst[check]
            if not judgement.ratio <= worst.ratio:  # NaN and inf count as the worst
                self.worst[check] = Worst(judgement.ratio, verdict.case.describe())
        self.skipped.update(verdict.skipped.keys())

    @property
    def worst_ratio(self) -> float:
        return max((worst.ratio for worst in self.worst.values()), default=0.0)

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
                    "worst_ratio": worst.ratio,
                    "worst_case": worst.case,
                }
                for check, worst in self.worst.items()
            },
        }


class SearchProgress:
    """A progress bar over the time budget, with the cases judged and the worst ratio so far; a no-op
    when `enabled` is False."""

    def __init__(self, budget_s: float, console: Console, *, enabled: bool):
        self.budget_s, self.enabled = budget_s, enabled
        self.progress = Progress(
            TextColumn("[bold]search[/]"),
            BarColumn(),
            TextColumn("{task.fields[cases]} cases, worst ratio {task.fields[worst]}, {task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("search", total=budget_s, cases=0, worst="-", status="searching")

    def __enter__(self) -> SearchProgress:
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self.enabled:
            self.progress.stop()

    def update(self, tally: Tally, elapsed_s: float, shrinking: bool) -> None:
        if not self.enabled:
            return
        status = f"shrinking ({tally.shrink_cases} tried)" if shrinking else "searching"
        self.progress.update(
            self.task,
            completed=min(elapsed_s, self.budget_s),
            cases=tally.cases,
            worst=f"{tally.worst_ratio:.3g}",
            status=status,
        )


def regime_table(tally: Tally) -> Table:
    table = Table(title="cases per regime (a case counts under each of its regimes)")
    table.add_column("regime")
    table.add_column("cases", justify="right")
    for regime, count in sorted(tally.per_regime.items()):
        table.add_row(regime, str(count))
    return table


def check_table(tally: Tally) -> Table:
    title = "worst relative ratio per check: impl vs truth over the relative gate's limit"
    table = Table(title=f"{title}; flagged above {HEADROOM:g}")
    for column, justify in (
        ("check", "left"),
        ("judged", "right"),
        ("skipped", "right"),
        ("worst ratio", "right"),
    ):
        table.add_column(column, justify=justify, no_wrap=True)
    table.add_column("on the case", no_wrap=True)
    for check, worst in tally.worst.items():
        ratio = f"{worst.ratio:.3g}" if tally.judged[check] else "-"
        style = "bold red" if not worst.ratio <= HEADROOM else None
        table.add_row(
            check, str(tally.judged[check]), str(tally.skipped[check]), ratio, worst.case, style=style
        )
    return table


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    """`search.json` in `out_dir`."""
    path = out_dir / REPORT_FILE
    write_json(report, path)
    return path
