"""The CI gate: does a report hold, and did any error grow too much over a baseline report?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conformance.report import REPORT_FORMAT, REPORT_VERSION


class ReportError(Exception):
    """A report file the gate cannot read."""


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportError(f"{path}: cannot read the report ({err})") from None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ReportError(f"{path}: not a conformance report (no 'format': {REPORT_FORMAT!r})")
    if report.get("version") != REPORT_VERSION:
        raise ReportError(
            f"{path}: report version {report.get('version')!r}; this gate reads {REPORT_VERSION}"
        )
    if not isinstance(report.get("checks"), list):
        raise ReportError(f"{path}: report has no 'checks' list")
    return report


def _ratio(check: dict[str, Any]) -> float | None:
    ratio = (check.get("metrics") or {}).get("gate_ratio")
    return float(ratio) if isinstance(ratio, (int, float)) else None


def breaches(
    report: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    growth_factor: float = 2.0,
    growth_min_ratio: float = 0.1,
) -> list[str]:
    """Why the report does not pass the gate, one line per reason; empty when it passes.

    A report breaches when a check failed or errored, when no check passed at all, and, against a
    baseline, when a check's ratio to its limit grew more than `growth_factor` times (ignored while
    it stays below `growth_min_ratio`), or when a check the baseline passed is now skipped.
    """
    found = [
        f"{check['id']}: {check['status']}: {check['message']}"
        for check in report["checks"]
        if check["status"] in ("failed", "error")
    ]
    if not any(check["status"] == "passed" for check in report["checks"]):
        found.append(f"no check passed ({len(report['checks'])} checks in the report)")
    if baseline is None:
        return found
    before = {check["id"]: check for check in baseline["checks"]}
    for check in report["checks"]:
        old = before.get(check["id"])
        if old is None or old["status"] != "passed":
            continue
        if check["status"] == "skipped":
            found.append(f"{check['id']}: passed in the baseline, now skipped: {check['message']}")
            continue
        new_ratio, old_ratio = _ratio(check), _ratio(old)
        if check["status"] != "passed" or new_ratio is None or old_ratio is None:
            continue
        if new_ratio > growth_min_ratio and new_ratio > growth_factor * old_ratio:
            growth = new_ratio / old_ratio if old_ratio > 0 else float("inf")
            found.append(
                f"{check['id']}: error grew over the baseline: ratio to the limit {old_ratio:.3g} → "
                f"{new_ratio:.3g} (×{growth:.3g}, allowed ×{growth_factor:g})"
            )
    return found
