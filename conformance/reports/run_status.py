"""Where a run stands, decided once: each check's status, how the run ended when it stopped early, and,
from its checks' statuses, the run's verdict word and exit code (docs/cli.md). `run`, the pytest plugin,
`gate` and the reports all read them from here."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from conformance.exit_codes import ExitCode

if TYPE_CHECKING:
    from conformance.judging.comparison import Comparison

STATUSES = ("passed", "failed", "error", "skipped")


def check_status(comparison: Comparison | None, skipped: bool = False) -> str:
    """One check's status: `skipped` when it could not run; `passed` or `failed` by the verdict of its
    `comparison`; `error` when it has none: the check raised before it had one (the implementation
    faulted or timed out, the checker itself raised, or a phase of pytest's around it failed)."""
    if skipped:
        return "skipped"
    if comparison is None:
        return "error"
    return "passed" if comparison.passed else "failed"


class StopKind(enum.Enum):
    """Why a run stopped before its plan ran; each value is the report's `stopped` text, its detail
    in the braces."""

    INTERRUPTED = "interrupted by {}"  # detail: the signal (SIGINT, SIGTERM), or KeyboardInterrupt
    CALL_TIMEOUT = "{}"  # detail: the timeout fault's message
    NOT_BUILT = "the implementation could not be built: {}"  # detail: the constructor's fault
    FIRST_FAILURE = "stopped at the first failing check (-x)"
    EARLY = "stopped early"  # by anything else of pytest's


@dataclasses.dataclass(frozen=True)
class Stop:
    """How a run that stopped early ended."""

    kind: StopKind
    detail: str = ""

    @property
    def text(self) -> str:
        """The report's `completion.stopped`."""
        return self.kind.value.format(self.detail)


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """Where a run stands (`run_status`)."""

    counts: dict[str, int]  # checks per status, in the order of STATUSES
    complete: bool  # it did not stop early, and ran as many checks as it planned
    nothing_checked: bool  # the exit code's cause: no check was selected, or every one was skipped
    verdict: str  # PASS, FAIL, ERROR, INCOMPLETE or NOTHING CHECKED
    exit_code: ExitCode


def run_status(
    statuses: Sequence[str],
    planned: int,
    faulted: bool,
    stop: Stop | None = None,
    breaches: Sequence[str] = (),
) -> RunStatus:
    """Where a run stands whose checks ended with `statuses` (each one of STATUSES), after it `planned`
    that many, with faults of the implementation or not (`faulted`), and how it ended when it stopped
    early (`stop`). `breaches` are the gate's further reasons why the run does not hold (a passed
    check's numbers, a baseline): each counts as a failing check.

    The verdict: INCOMPLETE when it stopped early or ran fewer checks than planned; else ERROR when a
    check errored, FAIL when one failed (or a breach), PASS when one passed, else NOTHING CHECKED.

    The exit code: IMPLEMENTATION when the implementation faulted, whatever else happened; else USAGE
    when the run was interrupted, FAIL when a check failed or errored (or a breach), USAGE when nothing
    was checked (no check selected, or every one skipped), and OK. A run incomplete for another reason
    (pytest stopped it) is OK here: its runner says more.
    """
    counts = {status: sum(s == status for s in statuses) for status in STATUSES}
    ran = len(statuses)
    complete = stop is None and ran >= planned
    interrupted = stop is not None and stop.kind is StopKind.INTERRUPTED
    failing = counts["failed"] + counts["error"] > 0 or bool(breaches)
    none_checked = planned == 0 or 0 < ran == counts["skipped"]
    if not complete:
        verdict = "INCOMPLETE"
    elif counts["error"]:
        verdict = "ERROR"
    elif failing:
        verdict = "FAIL"
    else:
        verdict = "PASS" if counts["passed"] else "NOTHING CHECKED"
    if faulted:
        code = ExitCode.IMPLEMENTATION
    elif interrupted:
        code = ExitCode.USAGE
    elif failing:
        code = ExitCode.FAIL
    elif none_checked:
        code = ExitCode.USAGE
    else:
        code = ExitCode.OK
    nothing_checked = code is ExitCode.USAGE and not interrupted
    return RunStatus(counts, complete, nothing_checked, verdict, code)
