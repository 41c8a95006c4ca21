"""Where a run stands, decided once (`conformance/reports/run_status.py`): each check's status, the run's
verdict word and exit code, for `run`, the plugin, `gate` and the reports; and the one table of exit
codes (`conformance/exit_codes.py`)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.exit_codes import ExitCode
from conformance.reports.run_status import Stop, StopKind, check_status, run_status

REPO = Path(__file__).resolve().parents[2]
P, F, E, S = "passed", "failed", "error", "skipped"
INTERRUPTED = Stop(StopKind.INTERRUPTED, "SIGINT")
OK, FAIL, USAGE, IMPL = ExitCode.OK, ExitCode.FAIL, ExitCode.USAGE, ExitCode.IMPLEMENTATION


@pytest.mark.parametrize(
    ("comparison", "skipped", "status"),
    [
        (SimpleNamespace(passed=True), False, "passed"),
        (SimpleNamespace(passed=False), False, "failed"),
        (None, True, "skipped"),
        (None, False, "error"),  # it raised before it had a comparison: a fault, a checker error, a setup
    ],
    ids=["holds", "out-of-tolerance", "skipped", "raised"],
)
def test_a_checks_status(comparison: SimpleNamespace | None, skipped: bool, status: str) -> None:
    assert check_status(comparison, skipped) == status  # type: ignore[arg-type]


# statuses, planned, faulted, stop, breaches → verdict, exit code, nothing_checked
TABLE = {
    "passing": ([P, P, S], 3, False, None, [], "PASS", OK, False),
    "out-of-tolerance": ([P, F, S], 3, False, None, [], "FAIL", FAIL, False),
    "checker-error": ([P, E], 2, False, None, [], "ERROR", FAIL, False),
    "implementation-fault": ([P, E, F], 3, True, None, [], "ERROR", IMPL, False),
    "a-fault-whatever-else": ([P, P], 2, True, None, [], "PASS", IMPL, False),
    "interrupted": ([P], 3, False, INTERRUPTED, [], "INCOMPLETE", USAGE, False),
    "interrupted-with-failure": ([F], 3, False, INTERRUPTED, [], "INCOMPLETE", USAGE, False),
    "interrupted-after-a-fault": ([E], 3, True, INTERRUPTED, [], "INCOMPLETE", IMPL, False),
    "interrupted-before-any-check": ([], 0, False, INTERRUPTED, [], "INCOMPLETE", USAGE, False),
    "call-timeout": ([P, E], 3, True, Stop(StopKind.CALL_TIMEOUT, "t"), [], "INCOMPLETE", IMPL, False),
    "not-built": ([], 3, True, Stop(StopKind.NOT_BUILT, "b"), [], "INCOMPLETE", IMPL, False),
    "exit-first": ([P, F], 3, False, Stop(StopKind.FIRST_FAILURE), [], "INCOMPLETE", FAIL, False),
    "fewer-than-planned": ([P], 2, False, None, [], "INCOMPLETE", OK, False),
    "every-check-skipped": ([S, S], 2, False, None, [], "NOTHING CHECKED", USAGE, True),
    "none-selected": ([], 0, False, None, [], "NOTHING CHECKED", USAGE, True),
    "gate-breach": ([P, P], 2, False, None, ["grew"], "FAIL", FAIL, False),
    "gate-breach-with-a-fault": ([P, E], 2, True, None, ["e"], "ERROR", IMPL, False),
    "gate-nothing-passed": ([S], 1, False, None, ["no check passed"], "FAIL", FAIL, False),
}  # fmt: skip


@pytest.mark.parametrize("row", list(TABLE))
def test_the_runs_verdict_and_exit_code(row: str) -> None:
    statuses, planned, faulted, stop, breaches, verdict, code, nothing_checked = TABLE[row]
    status = run_status(statuses, planned, faulted, stop, breaches)
    assert (status.verdict, status.exit_code, status.nothing_checked) == (verdict, code, nothing_checked)
    assert status.complete == (verdict != "INCOMPLETE")
    assert status.counts == {s: statuses.count(s) for s in (P, F, E, S)}


def test_a_stop_says_how_the_run_ended_in_the_reports_words() -> None:
    assert Stop(StopKind.INTERRUPTED, "SIGTERM").text == "interrupted by SIGTERM"
    assert Stop(StopKind.CALL_TIMEOUT, "implementation timeout: x").text == "implementation timeout: x"
    assert Stop(StopKind.NOT_BUILT, "boom").text == "the implementation could not be built: boom"
    assert Stop(StopKind.FIRST_FAILURE).text == "stopped at the first failing check (-x)"
    assert Stop(StopKind.EARLY).text == "stopped early"


def test_the_exit_codes_are_docs_cli_and_defined_once() -> None:
    assert [(code.name, int(code)) for code in ExitCode] == [
        ("OK", 0),
        ("FAIL", 1),
        ("USAGE", 2),
        ("IMPLEMENTATION", 3),
    ]
    defined = []
    for path in sorted((REPO / "conformance").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            defined += [f"{path.relative_to(REPO)}: {name}" for name in names if name.startswith("EXIT_")]
    assert defined == []
