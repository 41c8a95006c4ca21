"""`python -m conformance search`: draw, judge, shrink, write the reproducer, report (docs/search.md).

Exit status: 0 the budget ran out with nothing flagged; 1 a failure was found (its reproducer is in
`<out>/reproducer`). The command line (`conformance/cli.py`) turns bad arguments into exit 2 and an
implementation that cannot be built into exit 3.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from conformance.adapter import KDAAdapter
from conformance.adapters.guard import CallWatchdog
from conformance.checks.kinds import parse_check
from conformance.exit_codes import ExitCode
from conformance.policy import TolerancePolicy
from conformance.reports.json_file import write_json
from conformance.search import reproducer
from conformance.search.dumpcase import CASE_ID
from conformance.search.explore import SHRINK_BUDGET_S, Finding, explore
from conformance.search.judge import CHECKS, Judge
from conformance.search.report import REPORT_FILE, SearchProgress, Tally, check_table, regime_table
from conformance.search.space import MAX_SEQS, MAX_TOKENS, case_strategy
from conformance.search.weight_sets import weight_sets


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """What `python -m conformance search` was asked (docs/cli.md), in either space: `dumps` the dump
    set whose weights it runs on (None: `preset`'s synthetic weights; the serving space always has one).
    `max_seqs` and `progress` are the case space's alone."""

    impl: str
    adapter_class: type[KDAAdapter]
    options: Mapping[str, str]
    kernel: str
    policy: TolerancePolicy
    dumps: str | None
    dtypes: tuple[str, ...]
    budget_s: float
    seed: int
    out: Path
    preset: str = "mini"
    checks: tuple[str, ...] = (
        CHECKS  # the case space's judgement: `CHECKS`, or `GRADIENT_CHECKS` (`--space grad`)
    )
    max_tokens: int = MAX_TOKENS
    max_seqs: int = MAX_SEQS
    shrink_budget_s: float = SHRINK_BUDGET_S
    progress: bool = True
    watchdog: CallWatchdog | None = None


def replay_command(options: SearchOptions, dumps: str, dtypes: str, *more: str) -> str:
    """The `conformance run` of the implementation under test on `dumps` in `dtypes`, then `more`."""
    words = ["python", "-m", "conformance", "run", "--dumps", dumps, "--impl", options.impl]
    words += ["--kernel", options.kernel, "--dtypes", dtypes]
    for key, value in options.options.items():
        words += ["--impl-option", f"{key}={value}"]
    return shlex.join([*words, *more])


def run_search(options: SearchOptions, console: Console | None = None) -> int:
    """The whole command; the exit status (module docstring)."""
    console = console or Console(width=None if Console().is_terminal else 200)
    options.out.mkdir(parents=True, exist_ok=True)
    sets = weight_sets(options.dumps, options.preset, options.seed, options.adapter_class.FAMILIES)
    judge = Judge(
        options.adapter_class, options.kernel, options.options, options.policy, sets, options.watchdog,
        options.checks,
    )  # fmt: skip
    strategy = case_strategy(
        options.dtypes, list(sets), max_tokens=options.max_tokens, max_seqs=options.max_seqs
    )
    tally = Tally(options.checks)
    with SearchProgress(options.budget_s, console, enabled=options.progress) as progress:

        def seen(verdict, shrinking):
            tally.add(verdict, shrinking)
            progress.show(tally, shrinking)

        exploration = explore(
            judge.judge, strategy, budget_s=options.budget_s, seed=options.seed, on_verdict=seen,
            shrink_budget_s=options.shrink_budget_s,
        )  # fmt: skip
    console.print(regime_table(tally))
    console.print(check_table(tally))
    finding = None if exploration.finding is None else _found(options, judge, exploration.finding, console)
    rate = 60 * exploration.cases / exploration.drawing_s
    summary = (
        f"search: {exploration.cases} cases in {exploration.drawing_s:.0f} s ({rate:.0f}/min), "
        f"{tally.shrink_cases} more while shrinking; {exploration.seconds:.0f} s in all"
    )
    console.print(summary if finding else f"{summary}; nothing flagged (worst ratio {tally.worst_ratio:.3g})")
    report = {
        "impl": options.impl,
        "kernel": options.kernel,
        "options": dict(options.options),
        "weights": {name: weight_set.source for name, weight_set in sets.items()},
        "configs": {name: weight_set.config.to_manifest() for name, weight_set in sets.items()},
        "dtypes": list(options.dtypes),
        "checks": list(options.checks),
        "seed": options.seed,
        "budget_s": options.budget_s,
        "seconds": exploration.seconds,
        "drawing_s": exploration.drawing_s,
        "cases_per_minute": rate,
        "tally": tally.as_dict(),
        "finding": finding,
    }
    write_json(report, options.out / REPORT_FILE)
    console.print(f"report: {options.out / REPORT_FILE}")
    return ExitCode.OK if finding is None else ExitCode.FAIL


def _found(options: SearchOptions, judge: Judge, finding: Finding, console: Console) -> dict:
    """Write and replay the reproducer of `finding`, print what it says; its part of the report."""
    judged = finding.verdict.checks[finding.check]
    path = reproducer.write(judge, finding, options.out, options.impl)
    dtype = finding.case.dtype
    replayed = reproducer.replay(
        path, options.adapter_class, options.kernel, options.options, options.policy, dtype, [finding.check]
    )
    dirty = reproducer.builtin_failures(path, options.kernel, options.policy, dtype)
    command = replay_command(options, str(path), dtype)
    numbers = (
        f"(impl margin {judged.impl_margin:.3g} / nRMSE {judged.impl_nrmse:.3g} vs truth; the plain fp32 "
        f"pipeline {judged.base_margin:.3g} / {judged.base_nrmse:.3g})"
    )
    if parse_check(finding.check).kind.truth is None:
        numbers = "(a bit-exact check: its results moved)"
    found = f"[bold red]FOUND[/] {finding.check} after {finding.found_s:.0f} s: ratio {judged.ratio:.3g}"
    console.print(f"{found} {numbers}" + (f" — {judged.fault}" if judged.fault else ""))
    console.print(f"  first drawn: {finding.first.describe()}")
    console.print(
        f"  shrunk to:   {finding.case.describe()} ({finding.case.tokens} tokens, "
        f"{len(finding.case.seq_lens)} sequence(s); {finding.shrink_cases} cases in {finding.shrink_s:.0f} s)"
    )
    for r in replayed:
        outcome = "holds" if r.passed else f"FAILS, verdict {r.verdict}"
        console.print(f"  replay by the suite: {r.check} {outcome}: {r.summary}")
    fails = f"[yellow]the built-in kda_impl fails {[r.check for r in dirty]} of the reproducer too[/]"
    console.print(f"  {fails}" if dirty else "  the built-in kda_impl passes every check of the reproducer")
    console.print(f"  reproducer: {path}\n  replay: {command}")
    explain = ["python", "-m", "conformance", "diff", "--dumps", str(path), "--case", CASE_ID]
    console.print(f"  explain: {shlex.join([*explain, '--dtype', dtype, '--impl', options.impl])}")
    return {
        "check": finding.check,
        "found_s": finding.found_s,
        "first": finding.first.as_dict(),
        "case": finding.case.as_dict(),
        "tokens": finding.case.tokens,
        "sequences": len(finding.case.seq_lens),
        "shrink_s": finding.shrink_s,
        "shrink_cases": finding.shrink_cases,
        "judgement": judged.as_dict(),
        "flagged": [j.as_dict() for j in finding.verdict.flagged],
        "reproducer": str(path),
        "replay": [r.as_dict() for r in replayed],
        "kda_impl_fails": [r.as_dict() for r in dirty],
        "replay_command": command,
    }
