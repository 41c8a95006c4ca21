"""The implementation's faults of a run, in words: each distinct one once, with its checks and its
traceback (cut), for the terminal and report.md."""

from __future__ import annotations

from typing import Any

# Lines of one fault's traceback that the terminal shows, and how many faults it shows with theirs
# (report.json keeps them all).
TRACEBACK_LINES_SHOWN = 40
FAULTS_SHOWN = 5


def fault_lines(faults: list[dict[str, Any]]) -> list[str]:
    """Each distinct fault of a report once (the first `FAULTS_SHOWN`): its line, the checks it failed,
    its traceback (cut)."""
    lines: list[str] = []
    for fault in faults[:FAULTS_SHOWN]:
        checks = fault["checks"]
        shown = ", ".join(checks[:3]) + (f", … {len(checks) - 3} more" if len(checks) > 3 else "")
        lines.append(f"{fault['message']} ({fault['calls']} call(s); checks: {shown or 'none'})")
        trace = fault["traceback"].rstrip().splitlines()
        if len(trace) > TRACEBACK_LINES_SHOWN:
            cut = len(trace) - TRACEBACK_LINES_SHOWN
            trace = [
                trace[0],
                f"  … {cut} lines (report.json has them all)",
                *trace[-TRACEBACK_LINES_SHOWN + 1 :],
            ]
        lines += [f"    {line}" for line in trace]
    if len(faults) > FAULTS_SHOWN:
        lines.append(f"… and {len(faults) - FAULTS_SHOWN} more distinct faults: report.json lists every one")
    return lines
