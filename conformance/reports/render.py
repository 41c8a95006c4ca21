"""A report for people: the verdict line, the terminal summary and report.md."""

from __future__ import annotations

import collections
from typing import Any

from conformance.judging.measurement import percent
from conformance.reports.faults import fault_lines
from conformance.reports.json_file import json_safe
from conformance.reports.platform import (
    interpret_warning,
    platform_lines,
    platform_markdown,
)
from conformance.reports.run_status import STATUSES
from conformance.reports.tables import (
    ATTRIBUTION_NOTE,
    attribution_rows,
    contract_error_text,
    format_text_table,
    markdown_table,
    number_text,
    summary_rows,
    truth_error_text,
    verdict_text,
)
from kda_spec.families import KIMI_LINEAR

#: The terminal lists at most this many failing checks (or groups of checks with one message).
_BAD_LINES_SHOWN = 30


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


def _skip_reasons(report: dict[str, Any], shown: int = 2) -> str:
    reasons = collections.Counter(c["message"] for c in report["checks"] if c["status"] == "skipped")
    text = "; ".join(f"{n}: {reason}" for reason, n in reasons.most_common(shown))
    if len(reasons) > shown:
        text += f"; {len(reasons) - shown} other reasons"
    return f" ({text})" if text else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def headline(report: dict[str, Any]) -> str:
    """The first line of every summary: the verdict (the report's `verdict`, `run_status` decided it),
    what was checked, what was skipped and why, and how far an incomplete run got."""
    counts, completion = report["summary"], report["completion"]
    checked = counts["passed"] + counts["failed"]
    parts = [f"{checked} checked" + (f" ({counts['failed']} out of tolerance)" if counts["failed"] else "")]
    if counts["error"]:
        errors, faults = counts["error"], len(report["faults"])
        parts.append(f"{_count(errors, 'error')} ({_count(faults, 'distinct implementation fault')})")
    parts.append(f"{counts['skipped']} skipped{_skip_reasons(report)}")
    line = f"{report['verdict']}: " + ", ".join(parts)
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


def diagnosis_lines(report: dict[str, Any]) -> list[str]:
    """One line per reduced-precision matmul that failing fp32 checks match
    (`conformance.judging.matmul_diagnosis`): how many, what it is and the fix."""
    found: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for check in report["checks"]:
        diagnosis = (check.get("metrics") or {}).get("matmul_diagnosis")
        if diagnosis:
            found.setdefault(diagnosis["model"], (diagnosis, []))[1].append(check["id"])
    return [
        f"LIKELY CAUSE of {_count(len(ids), 'fp32 check')}: the errors match {diagnosis['means']}: "
        f"{diagnosis['fix']}"
        for diagnosis, ids in found.values()
    ]


def reference_precision_warning(report: dict[str, Any]) -> str | None:
    """The warning about a dump set whose fp32 reference ran with TF32 or unrecorded precision, or None
    (reports made before it record none)."""
    recorded = report.get("dumps", {}).get("reference_precision")
    return recorded.get("warning") if isinstance(recorded, dict) else None


def dumps_line(report: dict[str, Any]) -> str:
    """Which dump set ran and its KDA family: `dumps: golden (bundled, manifest sha256 …), family
    kimi-linear`, or its URL and digest."""
    dumps = report["dumps"]
    return f"dumps: {dumps.get('label') or dumps['url']}, family {dumps.get('family', KIMI_LINEAR.name)}"


def terminal_lines(report: dict[str, Any]) -> list[str]:
    """The verdict line, which dump set ran, where the run ran and how its kernels ran, a warning about a
    TF32 reference, the reduced-precision matmuls the errors match, the faults, the table, then the checks
    that did not hold; the interpret warning once more last."""
    header, body = summary_rows(report)
    reference_warning = reference_precision_warning(report)
    lines = [
        headline(report),
        dumps_line(report),
        *platform_lines(report),
        *([] if reference_warning is None else [reference_warning]),
        *diagnosis_lines(report),
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
    report = json_safe(report)
    impl, env, counts = report["implementation"], report["environment"], report["summary"]
    manifest = report["dumps"]["manifest"]
    reference = manifest.get("reference", {})
    word = report["verdict"]
    reference_warning = reference_precision_warning(report)
    lines = [
        "# KDA conformance report",
        "",
        f"**{word}**" + headline(report).removeprefix(word) + ".",
        "",
        f"- {dumps_line(report)}",
        *platform_markdown(report),
        *([] if reference_warning is None else ["", f"**{reference_warning}**"]),
        *[item for line in diagnosis_lines(report) for item in ("", f"**{line}**")],
        "",
        ", ".join(f"{counts[s]} {s}" for s in STATUSES) + f", {counts['close_to_limit']} close to the limit.",
        "",
        f"- implementation: `{impl['impl']}` ({impl['name']}), kernel requested `{impl['kernel']}`, "
        f"used {_kernels_used(impl['kernel_used'])}",
        f"- device: {env['backend']} ({env['device_kind']}), jax {env['versions'].get('jax', '?')}",
        f"- reference: {reference.get('name', '?')} on {reference.get('device', '?')}, "
        f"preset `{manifest['config'].get('preset')}`",
        f"- tolerances: `{report['tolerances']['source']}`",
        "",
        "## Summary",
        "",
        "Each cell: the worst ratio of a result's error to the gate's limit in that group of checks "
        "(<= 1 holds); ok* means some checks of the group were skipped. RFC tolerance: the RFC's "
        "element-wise limit for the row's dtype (fp32 1e-5, bf16 1e-3) and how many checks it would "
        "fail (reported, not gated; see docs/tolerance-policy.md).",
        "",
        *markdown_table(*summary_rows(report)),
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
    lines += markdown_table(*attribution_rows(report))
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
                number_text(metrics.get("max_abs")),
                number_text(metrics.get("max_rel")),
                _share(metrics.get("n_outside"), metrics.get("share_outside")),
                number_text(metrics.get("margin")),
                number_text(metrics.get("nrmse")),
                truth_error_text(truth, "impl") if metrics else "",
                truth_error_text(truth, "reference") if metrics else "",
                verdict_text(truth) if metrics else "",
                contract_error_text(metrics),
                _share(rfc.get("n_outside"), rfc.get("share_outside")),
                number_text(rfc.get("margin")),
                _where(metrics) if metrics else "",
            ]
        )
    lines += [*markdown_table(header, body), "", "</details>", ""]
    return "\n".join(lines)
