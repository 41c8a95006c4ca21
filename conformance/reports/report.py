"""The records of a run and report.json: what every check did, how the run ended, where it ran."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from conformance.checks.catalogue import CheckSpec
from conformance.judging.comparison import Comparison
from conformance.reports.check_record import metrics
from conformance.reports.run_status import RunStatus, Stop, run_status

REPORT_FORMAT = "kda-conformance-report"
REPORT_VERSION = 2


@dataclasses.dataclass
class Record:
    """The outcome of one check."""

    spec: CheckSpec
    status: str  # one of run_status.STATUSES, as `check_status` decides it
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


def records_status(records: list[Record], planned: int, faulted: bool, stop: Stop | None) -> RunStatus:
    """Where the run of `records` stands (`run_status`)."""
    return run_status([record.status for record in records], planned, faulted, stop)


def build_report(
    records: list[Record],
    meta: dict[str, Any],
    close_margin: float,
    planned: int | None = None,
    stop: Stop | None = None,
) -> dict[str, Any]:
    """The report of `records`, with the run's verdict word (`run_status`; faulted when `meta` lists
    faults); a run that stopped early (`stop`), or ran fewer checks than it `planned` (default: as many
    as it ran), is incomplete."""
    planned = len(records) if planned is None else planned
    status = records_status(records, planned, bool(meta.get("faults")), stop)
    completion = {
        "complete": status.complete,
        "planned": planned,
        "ran": len(records),
        "stopped": None if stop is None else stop.text,
    }
    summary = {
        **status.counts,
        "close_to_limit": sum(record.close_to_limit(close_margin) for record in records),
        "total": len(records),
    }
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "verdict": status.verdict,
        "completion": completion,
        "faults": [],
        "checker_errors": [],
        **meta,
        "summary": summary,
        "checks": [record.as_dict(close_margin) for record in records],
    }
