"""The records of a run and report.json: what every check did, how the run ended, where it ran."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from conformance.checks.catalogue import CheckSpec
from conformance.judging.comparison import Comparison
from conformance.reports.check_record import metrics

REPORT_FORMAT = "kda-conformance-report"
REPORT_VERSION = 2
STATUSES = ("passed", "failed", "error", "skipped")


@dataclasses.dataclass
class Record:
    """The outcome of one check."""

    spec: CheckSpec
    status: str  # one of STATUSES
    message: str
    duration_s: float
    comparison: Comparison | None = None

    def close_to_limit(self, close_margin: float) -> bool:
        return (
            self.status == "passed"
            and self.comparison is not None
            and self.comparison.gate_ratio > close_margin
        )

    def as_dict(self, close_margin: float) -> dict[str, Any]:
        return {
            "id": self.spec.id,
            "case": self.spec.case_id,
            "dtype": self.spec.dtype,
            "check": self.spec.check,
            "group": self.spec.group,
            "status": self.status,
            "message": self.message,
            "duration_s": round(self.duration_s, 4),
            "close_to_limit": self.close_to_limit(close_margin),
            "metrics": None if self.comparison is None else metrics(self.comparison),
        }


def summary_counts(records: list[Record], close_margin: float) -> dict[str, int]:
    counts = {status: sum(r.status == status for r in records) for status in STATUSES}
    counts["close_to_limit"] = sum(r.close_to_limit(close_margin) for r in records)
    counts["total"] = len(records)
    return counts


def build_report(
    records: list[Record],
    meta: dict[str, Any],
    close_margin: float,
    planned: int | None = None,
    stopped: str | None = None,
) -> dict[str, Any]:
    """The report of `records`; a run that `stopped` early (why), or ran fewer checks than it `planned`
    (default: as many as it ran), is incomplete."""
    planned = len(records) if planned is None else planned
    completion = {
        "complete": stopped is None and len(records) >= planned,
        "planned": planned,
        "ran": len(records),
        "stopped": stopped,
    }
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "completion": completion,
        "faults": [],
        "checker_errors": [],
        **meta,
        "summary": summary_counts(records, close_margin),
        "checks": [record.as_dict(close_margin) for record in records],
    }
