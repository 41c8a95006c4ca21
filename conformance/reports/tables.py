"""The tables of a report: the case × check-group summary (its cells, the RFC's column) and the
attribution table, as plain text (rich) or GitHub Markdown (tabulate)."""

from __future__ import annotations

import io
import math
from typing import Any

import rich.box
import rich.console
import rich.table
import tabulate

from conformance.checks.kinds import GROUPS
from conformance.judging.attribution import BLAMES
from conformance.reports.json_file import number_from_json
from conformance.judging.verdict import CONTRACT_MODE

_TEXT_WIDTH = 240  # wide enough that a table row never wraps in a log


def number_text(value: Any, digits: int = 3) -> str:
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


def _cell(checks: list[dict[str, Any]]) -> str:
    """One group of checks as one cell: its worst ratio to the limit and a verdict."""
    if not checks:
        return ""
    statuses = {check["status"] for check in checks}
    ratios = [number_from_json(check["metrics"]["gate_ratio"]) for check in checks if check["metrics"]]
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


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """A GitHub Markdown table (tabulate), `|` inside a cell escaped."""
    cells = [[cell.replace("|", "\\|") for cell in row] for row in body]
    return tabulate.tabulate(cells, headers=header, tablefmt="github", disable_numparse=True).splitlines()


ATTRIBUTION_NOTE = (
    "Each compared check's two sides against the float64 truth (the dump's, or for the kernels a "
    "float64 recurrence on the dumped inputs): margin under the check's tolerance and nRMSE of the "
    "implementation and of the reference, and who the difference comes from: `impl`, `reference`, "
    "`both`, or `conditioning` (equally close to the truth; docs/tolerance-policy.md). `n/a`: no truth "
    "applies: the dump has none for it, and the absolute gate alone decides, or the check is bit-exact "
    "(causality). Gate: which gate decided the check. "
    "Impl vs contract (bf16): nRMSE / gain of the implementation against the float64 model of the "
    "bf16 precision contract's roundings, where the gate `relative+contract` asks for it."
)


def contract_error_text(metrics: dict[str, Any]) -> str:
    """The implementation against the precision contract's model: `nRMSE / gain`; `n/a (why)` where the
    check's mode asks for it and there is no model; empty where its mode does not ask for it."""
    contract = metrics.get("contract", {})
    if contract.get("available"):
        numbers = f"{number_text(contract['impl']['nrmse'])} / {contract['impl']['gain']:+.2g}"
        if not contract["gated"]:
            return f"{numbers} (not gated: {contract['tokens']} tokens)"
        return f"{numbers} (exempt: closer to the truth than the model)" if contract["closer"] else numbers
    if metrics.get("mode") == CONTRACT_MODE:
        return f"n/a ({contract.get('reason', 'no model')})"
    return ""


def truth_error_text(truth: dict[str, Any], side: str) -> str:
    """One side's error against the truth: `margin / nRMSE`, or `n/a` without a truth."""
    if not truth.get("available"):
        return "n/a"
    error = truth[side]
    return f"{number_text(error['margin'])} / {number_text(error['nrmse'])}"


def verdict_text(truth: dict[str, Any]) -> str:
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
    body, counts = [], dict.fromkeys([*BLAMES, "n/a"], 0)
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
                    number_text(metrics.get("gate_ratio")),
                    truth_error_text(truth, "impl"),
                    truth_error_text(truth, "reference"),
                    verdict_text(truth),
                    contract_error_text(metrics),
                ]
            )
    tally = ", ".join(f"{n} {verdict}" for verdict, n in counts.items() if n)
    body.append(["every compared check", "", "", "", "", "", tally or "none", ""])
    return header, body
