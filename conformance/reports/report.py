"""The records of a run and the reports made of them: report.json, report.md and the terminal table."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import importlib.metadata
import io
import json
import math
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import rich.box
import rich.console
import rich.table
import tabulate

from conformance.checks.catalogue import GROUPS, CheckSpec
from conformance.adapters.guard import fault_lines
from conformance.judging.attribution import VERDICTS
from conformance.judging.comparison import Comparison
from conformance.judging.measurement import percent
from conformance.runtime.run_platform import interpret_warning, platform_block, platform_lines, platform_markdown
from conformance.judging.tolerances import CONTRACT_MODE

REPORT_FORMAT = "kda-conformance-report"
REPORT_VERSION = 2
STATUSES = ("passed", "failed", "error", "skipped")
_VERSIONED_PACKAGES = ("kda-conformance", "jax", "jaxlib", "flax", "numpy", "ml_dtypes")
_TEXT_WIDTH = 240  # wide enough that a table row never wraps in a log
#: The terminal lists at most this many failing checks (or groups of checks with one message).
_BAD_LINES_SHOWN = 30


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
            "metrics": None if self.comparison is None else self.comparison.as_dict(),
        }


def summary_counts(records: list[Record], close_margin: float) -> dict[str, int]:
    counts = {status: sum(r.status == status for r in records) for status in STATUSES}
    counts["close_to_limit"] = sum(r.close_to_limit(close_margin) for r in records)
    counts["total"] = len(records)
    return counts


def environment(kernel_used: Mapping[str, str]) -> dict[str, Any]:
    """Device and versions of the run, and the platform it ran on with how each dtype's kernels ran
    (`platform`: conformance/runtime/run_platform.py)."""
    import jax

    versions = {}
    for package in _VERSIONED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "devices": [str(device) for device in devices],
        "python": platform.python_version(),
        "platform": platform_block(kernel_used),
        "host": platform.platform(),
        "versions": versions,
    }


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


def _json_safe(value: Any) -> Any:
    """NaN and Inf as strings, so that report.json stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------- tables


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}g}"


def _exponent(value: float) -> str:
    """0.001 → 1e-3, 2.5e-05 → 2.5e-5: a limit as the RFC writes it."""
    mantissa, _, exponent = f"{value:e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _limit(tolerance: dict[str, Any]) -> str:
    """An element-wise tolerance in one short label: `1e-3`, or `1e-3 + 2e-3·|b|` when atol ≠ rtol."""
    atol, rtol = tolerance["atol"], tolerance["rtol"]
    return _exponent(atol) if atol == rtol else f"{_exponent(atol)} + {_exponent(rtol)}·|b|"


def _ratio(value: Any) -> float | None:
    """A recorded ratio as a float (report.json writes NaN and Inf as strings), None when absent."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _cell(checks: list[dict[str, Any]]) -> str:
    """One group of checks as one cell: its worst ratio to the limit and a verdict."""
    if not checks:
        return ""
    statuses = {check["status"] for check in checks}
    ratios = [_ratio(check["metrics"]["gate_ratio"]) for check in checks if check["metrics"]]
    numbers = [r for r in ratios if r is not None]
    worst = math.nan if any(math.isnan(r) for r in numbers) else max(numbers, default=None)
    ratio = "" if worst is None else f"{worst:.2g} "
    if "error" in statuses:
        return ratio + "ERROR"
    if "failed" in statuses:
        return ratio + "FAIL"
    if statuses == {"skipped"}:
        return "skip"
    return ratio + ("ok" if "skipped" not in statuses else "ok*")


def summary_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The case × check-group table: header and rows; the last column is the RFC's tolerance of the
    row's dtype and what it would say."""
    rows: dict[tuple[str, str], dict[str, list]] = {}
    for check in report["checks"]:
        rows.setdefault((check["case"], check["dtype"]), {}).setdefault(check["group"], []).append(check)
    rfc = report["tolerances"]["rfc"]
    header = ["case", "dtype", *GROUPS, "RFC tolerance"]
    body = [
        [case, dtype, *(_cell(groups.get(g, [])) for g in GROUPS), _rfc_cell(groups, rfc[dtype])]
        for (case, dtype), groups in rows.items()
    ]
    return header, body


def _rfc_cell(groups: dict[str, list[dict[str, Any]]], tolerance: dict[str, Any]) -> str:
    """The RFC's tolerance, and how many of the compared checks it would fail."""
    compared = [c["metrics"]["rfc"] for checks in groups.values() for c in checks if c["metrics"]]
    outside = sum(not rfc.get("passed", False) for rfc in compared)
    if not compared:
        return f"{_limit(tolerance)}: nothing compared"
    return f"{_limit(tolerance)}: " + (f"{outside}/{len(compared)} out" if outside else "holds")


def format_text_table(header: list[str], body: list[list[str]]) -> list[str]:
    """A plain-text table (rich, no colour), one string per line."""
    table = rich.table.Table(box=rich.box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in body:
        table.add_row(*row)
    text = io.StringIO()
    rich.console.Console(file=text, width=_TEXT_WIDTH, color_system=None, highlight=False).print(table)
    return [line.rstrip() for line in text.getvalue().splitlines()]


def _markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """A GitHub Markdown table (tabulate), `|` inside a cell escaped."""
    cells = [[cell.replace("|", "\\|") for cell in row] for row in body]
    return tabulate.tabulate(cells, headers=header, tablefmt="github", disable_numparse=True).splitlines()


def _kernels_used(by_dtype: dict[str, str]) -> str:
    kernels = set(by_dtype.values())
    if len(kernels) == 1:
        return f"`{kernels.pop()}`"
    return ", ".join(f"`{kernel}` ({dtype})" for dtype, kernel in by_dtype.items()) or "none"


def _share(count: int | None, share: Any) -> str:
    if count is None or not isinstance(share, float):
        return ""
    return f"{count} ({percent(share)})"


def _where(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{axis} {i}" for axis, i in metrics.get("worst", {}).get("index", {}).items())


def verdict_word(report: dict[str, Any]) -> str:
    """PASS, FAIL (out of tolerance), ERROR (the implementation or the checker raised), INCOMPLETE (the
    run stopped before its plan ran), or NOTHING CHECKED (every check skipped)."""
    counts = report["summary"]
    if not report["completion"]["complete"]:
        return "INCOMPLETE"
    if counts["error"]:
        return "ERROR"
    if counts["failed"]:
        return "FAIL"
    return "PASS" if counts["passed"] else "NOTHING CHECKED"


def _skip_reasons(report: dict[str, Any], shown: int = 2) -> str:
    reasons = collections.Counter(c["message"] for c in report["checks"] if c["status"] == "skipped")
    text = "; ".join(f"{n}: {reason}" for reason, n in reasons.most_common(shown))
    if len(reasons) > shown:
        text += f"; {len(reasons) - shown} other reasons"
    return f" ({text})" if text else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def headline(report: dict[str, Any]) -> str:
    """The first line of every summary: the verdict, what was checked, what was skipped and why, and
    how far an incomplete run got."""
    counts, completion = report["summary"], report["completion"]
    checked = counts["passed"] + counts["failed"]
    parts = [f"{checked} checked" + (f" ({counts['failed']} out of tolerance)" if counts["failed"] else "")]
    if counts["error"]:
        errors, faults = counts["error"], len(report["faults"])
        parts.append(f"{_count(errors, 'error')} ({_count(faults, 'distinct implementation fault')})")
    parts.append(f"{counts['skipped']} skipped{_skip_reasons(report)}")
    line = f"{verdict_word(report)}: " + ", ".join(parts)
    if not completion["complete"]:
        line += (
            f"; {completion['ran']} of {completion['planned']} planned checks ran: {completion['stopped']}"
        )
    return line


def _bad_check_lines(report: dict[str, Any]) -> list[str]:
    """The checks that failed or errored, those sharing one message on one line, at most
    `_BAD_LINES_SHOWN` lines; those an implementation fault failed in one line (the faults are listed
    once each above)."""
    faulted = {check_id for fault in report["faults"] for check_id in fault["checks"]}
    groups: dict[tuple[str, str], list[str]] = {}
    for check in report["checks"]:
        if check["status"] in ("failed", "error") and check["id"] not in faulted:
            groups.setdefault((check["status"], check["message"]), []).append(check["id"])
    lines = []
    if faulted:
        faults = len(report["faults"])
        lines.append(f"ERROR {len(faulted)} checks: the {_count(faults, 'implementation fault')} above")
    for (status, message), ids in list(groups.items())[:_BAD_LINES_SHOWN]:
        if len(ids) == 1:
            lines.append(f"{status.upper()} {ids[0]}: {message}")
        else:
            named = ", ".join(ids[:3]) + (", …" if len(ids) > 3 else "")
            lines.append(f"{status.upper()} {len(ids)} checks ({named}): {message}")
    if len(groups) > _BAD_LINES_SHOWN:
        hidden = sum(len(ids) for ids in list(groups.values())[_BAD_LINES_SHOWN:])
        lines.append(f"… and {hidden} more checks that did not hold: report.md lists every one")
    return lines


def _problem_lines(report: dict[str, Any]) -> list[str]:
    """Each implementation fault and checker error once, with its traceback (cut)."""
    lines = []
    if report["faults"]:
        lines.append("implementation faults, each once with the adapter's traceback:")
        lines += fault_lines(report["faults"])
    for error in report["checker_errors"]:
        lines.append(f"checker error (a bug of the conformance suite; please report it): {error['message']}")
        lines += [f"    {line}" for line in error["traceback"].rstrip().splitlines()]
    return lines


def terminal_lines(report: dict[str, Any]) -> list[str]:
    """The verdict line, where the run ran and how its kernels ran, the faults, the table, then the checks
    that did not hold; the interpret warning once more last."""
    header, body = summary_rows(report)
    lines = [
        headline(report),
        *platform_lines(report),
        *_problem_lines(report),
        *format_text_table(header, body),
    ]
    lines.append(
        "cells: worst ratio to the gate's limit in the group (<= 1 holds), ok* = some skipped; "
        "RFC tolerance: the RFC's limit for the row's dtype and the checks outside it (reported, not gated)"
    )
    header, rows = attribution_rows(report)
    lines.append(f"attribution against the float64 truth: {rows[-1][header.index('verdict')]}")
    lines += _bad_check_lines(report)
    counts = report["summary"]
    lines.append(
        ", ".join(f"{counts[s]} {s}" for s in STATUSES) + f" ({counts['close_to_limit']} close to the limit)"
    )
    warning = interpret_warning(report)
    return lines if warning is None else [*lines, warning]


def markdown(report: dict[str, Any]) -> str:
    """report.md: what was run, the summary table, what failed, and every check's numbers."""
    report = _json_safe(report)
    impl, env, counts = report["implementation"], report["environment"], report["summary"]
    manifest = report["dumps"]["manifest"]
    reference = manifest.get("reference", {})
    word = verdict_word(report)
    lines = [
        "# KDA conformance report",
        "",
        f"**{word}**" + headline(report).removeprefix(word) + ".",
        "",
        *platform_markdown(report),
        "",
        ", ".join(f"{counts[s]} {s}" for s in STATUSES) + f", {counts['close_to_limit']} close to the limit.",
        "",
        f"- implementation: `{impl['impl']}` ({impl['name']}), kernel requested `{impl['kernel']}`, "
        f"used {_kernels_used(impl['kernel_used'])}",
        f"- device: {env['backend']} ({env['device_kind']}), jax {env['versions'].get('jax', '?')}",
        f"- dumps: `{report['dumps']['url']}`, preset `{manifest['config'].get('preset')}`, "
        f"reference {reference.get('name', '?')} on {reference.get('device', '?')}",
        f"- tolerances: `{report['tolerances']['source']}`",
        "",
        "## Summary",
        "",
        "Each cell: the worst ratio of a result's error to the gate's limit in that group of checks "
        "(<= 1 holds); ok* means some checks of the group were skipped. RFC tolerance: the RFC's "
        "element-wise limit for the row's dtype (fp32 1e-5, bf16 1e-3) and how many checks it would "
        "fail (reported, not gated; see docs/tolerance-policy.md).",
        "",
        *_markdown_table(*summary_rows(report)),
    ]
    if report["faults"] or report["checker_errors"]:
        lines += ["", "## Faults", "", "Each distinct fault once, with its traceback.", "", "```"]
        lines += [*_problem_lines(report), "```"]
    bad = [check for check in report["checks"] if check["status"] in ("failed", "error")]
    if bad:
        lines += ["", "## Failures", ""]
        lines += [f"- `{check['id']}` ({check['status']}): {check['message']}" for check in bad]
    close = [check for check in report["checks"] if check["close_to_limit"]]
    if close:
        lines += ["", "## Close to the limit", "", f"<details><summary>{len(close)} checks</summary>", ""]
        lines += [
            f"- `{c['id']}`: ratio {c['metrics']['gate_ratio']:.3g}, worst at {_where(c['metrics'])}"
            for c in close
        ]
        lines += ["", "</details>"]
    lines += ["", "## Attribution against the float64 truth", "", ATTRIBUTION_NOTE, ""]
    lines += _markdown_table(*attribution_rows(report))
    lines += ["", "## Every check", "", "<details><summary>numbers</summary>", ""]
    header = [
        "check",
        "status",
        "gate",
        "max abs",
        "max rel",
        "outside",
        "margin",
        "nRMSE",
        "impl vs truth",
        "reference vs truth",
        "verdict",
        "impl vs contract",
        "RFC outside",
        "RFC margin",
        "worst at",
    ]
    body = []
    for check in report["checks"]:
        metrics = check["metrics"] or {}
        rfc = metrics.get("rfc", {})
        truth = metrics.get("truth", {})
        body.append(
            [
                check["id"],
                check["status"] if check["status"] != "skipped" else f"skipped: {check['message']}",
                metrics.get("judged_by", ""),
                _number(metrics.get("max_abs")),
                _number(metrics.get("max_rel")),
                _share(metrics.get("n_outside"), metrics.get("share_outside")),
                _number(metrics.get("margin")),
                _number(metrics.get("nrmse")),
                _truth_error(truth, "impl") if metrics else "",
                _truth_error(truth, "reference") if metrics else "",
                _verdict(truth) if metrics else "",
                _contract_error(metrics),
                _share(rfc.get("n_outside"), rfc.get("share_outside")),
                _number(rfc.get("margin")),
                _where(metrics) if metrics else "",
            ]
        )
    lines += [*_markdown_table(header, body), "", "</details>", ""]
    return "\n".join(lines)


ATTRIBUTION_NOTE = (
    "Each compared check's two sides against the float64 truth (the dump's, or for the kernels a "
    "float64 recurrence on the dumped inputs): margin under the check's tolerance and nRMSE of the "
    "implementation and of the reference, and who the difference comes from: `impl`, `reference`, "
    "`both`, or `conditioning` (equally close to the truth; docs/tolerance-policy.md). `n/a`: the dump "
    "has no truth for it, and the absolute gate alone decides. Gate: which gate decided the check. "
    "Impl vs contract (bf16): nRMSE / gain of the implementation against the float64 model of the "
    "bf16 precision contract's roundings, where the gate `relative+contract` asks for it."
)


def _contract_error(metrics: dict[str, Any]) -> str:
    """The implementation against the precision contract's model: `nRMSE / gain`; `n/a (why)` where the
    check's mode asks for it and there is no model; empty where its mode does not ask for it."""
    contract = metrics.get("contract", {})
    if contract.get("available"):
        numbers = f"{_number(contract['impl']['nrmse'])} / {contract['impl']['gain']:+.2g}"
        if not contract["gated"]:
            return f"{numbers} (not gated: {contract['tokens']} tokens)"
        return f"{numbers} (exempt: closer to the truth than the model)" if contract["closer"] else numbers
    if metrics.get("mode") == CONTRACT_MODE:
        return f"n/a ({contract.get('reason', 'no model')})"
    return ""


def _truth_error(truth: dict[str, Any], side: str) -> str:
    """One side's error against the truth: `margin / nRMSE`, or `n/a` without a truth."""
    if not truth.get("available"):
        return "n/a"
    error = truth[side]
    return f"{_number(error['margin'])} / {_number(error['nrmse'])}"


def _verdict(truth: dict[str, Any]) -> str:
    return truth["verdict"] if truth.get("available") else f"n/a ({truth.get('reason', 'no truth')})"


def attribution_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The failed checks and those a side is clearly worse in, with both sides' errors against the
    truth; then one row counting each verdict over every compared check."""
    header = [
        "check",
        "status",
        "gate",
        "gate ratio",
        "impl vs truth",
        "reference vs truth",
        "verdict",
        "impl vs contract",
    ]
    body, counts = [], dict.fromkeys([*VERDICTS, "n/a"], 0)
    for check in report["checks"]:
        metrics = check["metrics"]
        if not metrics:
            continue
        truth = metrics.get("truth", {})
        verdict = truth["verdict"] if truth.get("available") else "n/a"
        counts[verdict] += 1
        if check["status"] == "failed" or verdict in ("impl", "reference", "both"):
            body.append(
                [
                    check["id"],
                    check["status"],
                    metrics.get("judged_by", "absolute"),
                    _number(metrics.get("gate_ratio")),
                    _truth_error(truth, "impl"),
                    _truth_error(truth, "reference"),
                    _verdict(truth),
                    _contract_error(metrics),
                ]
            )
    tally = ", ".join(f"{n} {verdict}" for verdict, n in counts.items() if n)
    body.append(["every compared check", "", "", "", "", "", tally or "none", ""])
    return header, body
