"""A report as the suite writes it, around check records a test made itself (for the gate's tests)."""

from __future__ import annotations

from typing import Any

from conformance.reports.report import REPORT_FORMAT, REPORT_VERSION

DIGEST = "a" * 64


def report_of(checks: list[dict[str, Any]], digest: str | None = DIGEST) -> dict[str, Any]:
    """A complete run's report of `checks` on a dump set whose manifest has sha256 `digest` (None: a
    report that records none)."""
    dumps = {"url": "golden"} | ({"manifest_sha256": digest} if digest else {})
    completion = {"complete": True, "planned": len(checks), "ran": len(checks), "stopped": None}
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "completion": completion,
        "dumps": dumps,
        "checks": checks,
    }


def criterion(check: dict[str, Any], statistic: str) -> dict[str, Any]:
    """The criterion recorded in `check` whose statistic starts with `statistic`."""
    return next(c for c in check["metrics"]["criteria"] if c["statistic"].startswith(statistic))
