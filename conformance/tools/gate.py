"""The CI gate: does a report hold, and did any error grow too much over a baseline report?

Nothing in a report is taken on trust: each passed check's verdict is decided again by the suite's own
engine (`conformance.judging.verdict.decide`) from the criteria it records — each statistic with the numbers
of its bound — and its gate mode; a check the baseline has and the report lacks is a breach, and two
reports are only compared when they were made on the same dump set (the sha256 of its manifest).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conformance.judging.verdict import MODE_GATES, Verdict, decide
from conformance.reports.check_record import criterion_from_record
from conformance.reports.platform import devices_label
from conformance.reports.report import REPORT_FORMAT, REPORT_VERSION
from conformance.reports.run_status import STATUSES, RunStatus, run_status
from conformance.runtime.run_platform import is_interpreted, kernel_execution, recorded_platform


class ReportError(Exception):
    """A report file the gate cannot read, or one whose content is malformed."""


def load_report(path: str | Path) -> dict[str, Any]:
    """A report whose structure is sound (every check with its fields, of the right types)."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ReportError(f"{path}: cannot read the report ({err})") from None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ReportError(f"{path}: not a conformance report (no 'format': {REPORT_FORMAT!r})")
    if report.get("version") != REPORT_VERSION:
        raise ReportError(
            f"{path}: report version {report.get('version')!r}; this gate reads {REPORT_VERSION}"
        )
    checks = report.get("checks")
    if not isinstance(checks, list):
        raise ReportError(f"{path}: report has no 'checks' list")
    seen: set[str] = set()
    for index, check in enumerate(checks):
        _check_structure(check, f"{path}: checks[{index}]")
        if check["id"] in seen:
            raise ReportError(f"{path}: checks[{index}]: check id {check['id']!r} appears twice")
        seen.add(check["id"])
    _check_complete(report.get("completion"), len(checks), path)
    dumps = report.get("dumps", {})
    if not isinstance(dumps, dict) or not isinstance(dumps.get("manifest_sha256", ""), str):
        raise ReportError(f"{path}: 'dumps' must be an object whose 'manifest_sha256' is a string")
    return report


def _check_complete(completion: Any, checks: int, path: Path) -> None:
    """An incomplete run (interrupted, stopped by a call timeout or `-x`) is no verdict: a ReportError.
    The count of its checks is held against its plan, not its own word."""
    if not isinstance(completion, dict) or not isinstance(completion.get("planned"), int):
        raise ReportError(f"{path}: report has no 'completion' block with the number of 'planned' checks")
    stopped = completion.get("stopped")
    if stopped is not None or checks != completion["planned"] or completion.get("complete") is not True:
        raise ReportError(
            f"{path}: the run is incomplete: {checks} of {completion['planned']} planned checks ran"
            f" ({stopped or 'stopped early'}); an incomplete run is no verdict"
        )


def _check_structure(check: Any, label: str) -> None:
    if not isinstance(check, dict):
        raise ReportError(f"{label}: expected an object, found {check!r}")
    for field in ("id", "status", "message"):
        if not isinstance(check.get(field), str):
            raise ReportError(f"{label}: {field!r} must be a string, found {check.get(field)!r}")
    if check["status"] not in STATUSES:
        raise ReportError(f"{label}: 'status' must be one of {list(STATUSES)}, found {check['status']!r}")
    metrics = check.get("metrics")
    if metrics is not None and not isinstance(metrics, dict):
        raise ReportError(f"{label}: 'metrics' must be an object or null, found {metrics!r}")
    if check["status"] == "passed":
        if metrics is None:
            raise ReportError(f"{label} ({check['id']}): a passed check must record its 'metrics'")
        _recorded_verdict(metrics, f"{label} ({check['id']})")


def _recorded_verdict(metrics: dict[str, Any], label: str) -> Verdict:
    """A passed check's verdict, decided again (`conformance.judging.verdict.decide`) from the criteria
    and the gate mode it records; a ReportError names what is malformed, missing or impossible."""
    mode = metrics.get("mode")
    if mode not in MODE_GATES:
        raise ReportError(f"{label}: metrics 'mode' must be one of {list(MODE_GATES)}, found {mode!r}")
    records = metrics.get("criteria")
    if not isinstance(records, list):
        raise ReportError(f"{label}: metrics 'criteria' must be a list, found {records!r}")
    try:
        criteria = [
            criterion_from_record(record, f"{label}: criteria[{i}]") for i, record in enumerate(records)
        ]
    except ValueError as err:
        raise ReportError(str(err)) from None
    gates = {criterion.gate for criterion in criteria}
    # Each gate a passed check's record says it measured is among its criteria: a criterion left out
    # of the list cannot turn a failing check into a passing one.
    required = {"finite": True, "absolute": True}
    for gate, block in (("relative", "truth"), ("contract", "contract")):
        recorded = metrics.get(block, {"available": False})
        if not isinstance(recorded, dict) or not isinstance(recorded.get("available"), bool):
            raise ReportError(f"{label}: metrics {block!r} must be an object with 'available' true or false")
        required[gate] = recorded["available"]
    missing = sorted(gate for gate, needed in required.items() if needed and gate not in gates)
    if missing:
        raise ReportError(f"{label}: metrics 'criteria' has none of the {missing} gate(s) it measured")
    for criterion in criteria:
        if criterion.gate != "finite" and not criterion.bound > 0:
            raise ReportError(
                f"{label}: criterion {criterion.statistic!r} has the bound {criterion.bound}: not > 0"
            )
    return decide(mode, criteria)


def _recomputed(check: dict[str, Any]) -> tuple[list[str], float | None]:
    """Why a passed check's recorded criteria do not hold, and its ratio to the limit (the largest
    deciding criterion as a share of its bound), recomputed; ([], None) for a check that did not pass."""
    if check["status"] != "passed":
        return [], None
    metrics = check["metrics"]
    verdict = _recorded_verdict(metrics, check["id"])
    reasons = [criterion.statement() for criterion in verdict.deciding if not criterion.holds]
    recorded = metrics.get("failures", [])
    if recorded:
        reasons.append(f"recorded failures {recorded}")
    return reasons, (verdict.ratio() if not reasons else None)


def gate_status(report: dict[str, Any], found: list[str]) -> RunStatus:
    """Where a complete report stands with the breaches `found` in it (`run_status`): its checks
    counted by status (not read from its summary); its exit code 1 where it breaches, 3 where it
    breaches and records a fault of the implementation (as `run` exited), else 0."""
    statuses = [check["status"] for check in report["checks"]]
    faulted = bool(found) and bool(report.get("faults"))
    return run_status(statuses, report["completion"]["planned"], faulted, None, found)


def dump_set_mismatch(report: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """Why the two reports cannot be compared (different or unrecorded dump sets), or None."""
    digests = [r.get("dumps", {}).get("manifest_sha256") for r in (report, baseline)]
    if digests[0] is None or digests[1] is None:
        which = "the report" if digests[0] is None else "the baseline"
        return f"{which} records no dump-set digest (dumps.manifest_sha256), so the sets cannot be compared"
    if digests[0] != digests[1]:
        return (
            f"the report was made on another dump set than the baseline "
            f"(manifest sha256 {digests[0][:12]}… against {digests[1][:12]}…)"
        )
    return None


def breaches(
    report: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    growth_factor: float = 2.0,
    growth_min_ratio: float = 0.1,
) -> list[str]:
    """Why the report does not pass the gate, one line per reason; empty when it passes.

    A report breaches when a check failed or errored, when a check recorded as passed has numbers
    outside its recorded limits (or NaN), when no check passed at all, and, against a baseline, when
    a check of the baseline is missing, when a check's ratio to its limit grew more than
    `growth_factor` times (ignored while it stays below `growth_min_ratio`), or when a check the
    baseline passed is now skipped.
    """
    found = [
        f"{check['id']}: {check['status']}: {check['message']}"
        for check in report["checks"]
        if check["status"] in ("failed", "error")
    ]
    ratios: dict[str, float | None] = {}
    for check in report["checks"]:
        reasons, ratios[check["id"]] = _recomputed(check)
        if reasons:
            found.append(f"{check['id']}: recorded as passed, but its numbers fail: {'; '.join(reasons)}")
    if not any(check["status"] == "passed" for check in report["checks"]):
        found.append(f"no check passed ({len(report['checks'])} checks in the report)")
    if baseline is None:
        return found
    now = {check["id"]: check for check in report["checks"]}
    for old in baseline["checks"]:
        check = now.get(old["id"])
        if check is None:
            found.append(f"{old['id']}: in the baseline ({old['status']}), missing from this report")
            continue
        if old["status"] != "passed":
            continue
        if check["status"] == "skipped":
            found.append(f"{check['id']}: passed in the baseline, now skipped: {check['message']}")
            continue
        new_ratio, old_ratio = ratios[check["id"]], _recomputed(old)[1]
        if new_ratio is None or old_ratio is None:
            continue
        if new_ratio > growth_min_ratio and new_ratio > growth_factor * old_ratio:
            growth = new_ratio / old_ratio if old_ratio > 0 else float("inf")
            found.append(
                f"{check['id']}: error grew over the baseline: ratio to the limit {old_ratio:.3g} → "
                f"{new_ratio:.3g} (×{growth:.3g}, allowed ×{growth_factor:g})"
            )
    return found


def platform_breaches(report: Mapping[str, Any], required: str) -> list[str]:
    """Why the report was not made on `required`, one line per reason: another platform, no record of
    one, or Pallas kernels that ran in the interpreter (recomputed from the recorded `kernels`; accepted
    when `required` is `cpu`, where Pallas has nothing else)."""
    platform = recorded_platform(report)
    if platform is None:
        return [f"platform: required {required}, but the report records none (environment.platform)"]
    found = []
    if platform.get("name") != required:
        found.append(f"platform: required {required}, the report was made on {devices_label(platform)}")
    kernels = platform.get("kernels", {})
    if not isinstance(kernels, Mapping) or not all(isinstance(k, str) for k in kernels.values()):
        return [*found, f"platform: 'kernels' must map each dtype to a string, found {kernels!r}"]
    if required != "cpu":
        found += [
            f"platform: required {required}, but the {dtype} kernels ran {execution}: Pallas interpreted, "
            "never compiled"
            for dtype, execution in kernels.items()
            if is_interpreted(kernel_execution(execution, str(platform.get("name"))))
        ]
    return found
