"""`python -m conformance power`'s command and reports: the run (measure, then write power.json and
power.md), the table, the goals missed."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.reports.json_file import write_json
from conformance.reports.output_files import check_writable_file
from conformance.reports.tables import format_text_table, markdown_table
from conformance.tools.power import (
    BISECT_STEPS,
    GRID,
    POLICIES,
    defects,
    measure_power,
    run_dtypes,
    select_defects,
)

REPORT_FILES = ("power.json", "power.md")


def _cell(row: dict[str, Any], policy: str) -> str:
    if not row["measured"]:
        return "n/a"
    found = row[policy]
    if row["structural"]:
        return f"caught ({found['caught_by']})" if found["caught"] else "not caught"
    if found["eps"] is None:
        return f"not caught at {GRID[-1]:.0e}"
    return f"{'≤ ' if found['below'] is None else ''}{found['eps']:.2g} ({found['caught_by']})"


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["defect", "dtype", "cases", "default policy", "absolute gate", "goal", "met"]
    body = [
        [
            row["defect"],
            row["dtype"],
            " ".join(row["cases"]),
            _cell(row, "default"),
            _cell(row, "absolute"),
            "caught" if row["structural"] else f"ε ≤ {row['goal']:g}",
            "yes" if row["met"] else ("no" if row["measured"] else f"no: {row['reason']}"),
        ]
        for row in result["rows"]
    ]
    return header, body


def baseline_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for dtype, base in result["baseline"].items():
        for policy in POLICIES:
            failed = base["failed"][policy]
            state = f"FAILS {len(failed)} check(s): {', '.join(failed[:5])}" if failed else "nothing caught"
            lines.append(f"no defect ({dtype}, {policy}): {state}")
    return lines


def missed(result: dict[str, Any]) -> list[str]:
    """Why the run misses its goals: a baseline failing the default policy, a defect not caught in time."""
    reasons = [
        f"the unmodified implementation fails the default policy ({dtype}): {', '.join(failed[:3])}"
        for dtype, base in result["baseline"].items()
        if (failed := base["failed"]["default"])
    ]
    for row in result["rows"]:
        if row["met"]:
            continue
        if not row["measured"]:
            reasons.append(f"{row['defect']} ({row['dtype']}): not measured, {row['reason']}")
        elif row["structural"]:
            reasons.append(f"{row['defect']} ({row['dtype']}): not caught")
        else:
            eps = row["default"]["eps"]
            at = "not caught at 1e-1" if eps is None else f"caught only at ε = {eps:.2g}"
            reasons.append(f"{row['defect']} ({row['dtype']}): {at}, goal ε ≤ {row['goal']:g}")
    return reasons


def comparison_line(result: dict[str, Any]) -> str:
    """Whether the default policy catches every ε-defect at an ε no larger than the absolute gate."""
    rows = [r for r in result["rows"] if r["measured"] and not r["structural"]]

    def eps(row: dict[str, Any], policy: str) -> float:
        return math.inf if row[policy]["eps"] is None else row[policy]["eps"]

    def edge(row: dict[str, Any]) -> str:
        """How close to its limit the check the absolute gate caught it with was without the defect."""
        check = row["absolute"]["caught_by"]
        ratio = result["baseline"].get(row["dtype"], {}).get("ratios", {}).get("absolute", {}).get(check)
        return "" if ratio is None else f" [{check} at {ratio:.2f} of its limit without it]"

    weaker = [
        f"{r['defect']} ({r['dtype']}){edge(r)}" for r in rows if eps(r, "default") > eps(r, "absolute")
    ]
    structural = [r for r in result["rows"] if r["measured"] and r["structural"]]
    weaker += [
        f"{r['defect']} ({r['dtype']})"
        for r in structural
        if r["absolute"]["caught"] and not r["default"]["caught"]
    ]
    total = len(rows) + len(structural)
    text = (
        f"default policy at least as powerful as the absolute gate in {total - len(weaker)} of {total} rows"
    )
    return text + (f"; weaker in: {', '.join(weaker)}" if weaker else "")


def markdown(result: dict[str, Any]) -> str:
    header, body = table(result)
    meta = result["run"]
    lines = [
        "# The suite's power",
        "",
        f"`{meta['command']}` — dump set `{meta['dumps']}`, kernel `{meta['kernel']}`, "
        f"{meta['seconds']:.0f} s, {meta['date']}.",
        "",
        "Smallest ε caught (the check that caught it), searched on the decade grid 1e-7 … 1e-1 and "
        f"bisected {BISECT_STEPS} times in log space (within ×1.33 above the threshold); `default policy`: "
        "the policy file as it is; `absolute gate`: every check by its absolute limits alone.",
        "",
        *markdown_table(header, body),
        "",
        *(f"- {line}" for line in baseline_lines(result)),
        f"- {comparison_line(result)}",
    ]
    reasons = missed(result)
    lines += ["", "Goals: " + ("all met." if not reasons else "missed:"), *(f"- {r}" for r in reasons)]
    return "\n".join(lines) + "\n"


def check_report_dir(folder: Path) -> None:
    """Make `folder` and make sure the reports can be written there; ValueError says why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--report-dir {folder}: cannot write the reports there ({err})") from None
    for name in REPORT_FILES:
        check_writable_file(folder / name, "--report-dir")


def run(
    dumps: DumpSet,
    policy: TolerancePolicy,
    *,
    dtype: str,
    cases: list[str] | None,
    defect_patterns: list[str] | None,
    kernel: str,
    report_dir: Path,
    command: str,
    progress: Callable[[str], None] = print,
) -> tuple[dict[str, Any], list[str]]:
    """Measure, write power.json / power.md into `report_dir`; (the result, the goals missed).
    ValueError for unusable arguments, before anything runs."""
    if cases:
        dumps.case_ids(cases)  # a DumpError names an unknown case
    dtypes = run_dtypes(dumps, dtype)
    chosen = select_defects(defects(list(dumps.weights())), defect_patterns)
    check_report_dir(report_dir)
    started = time.perf_counter()
    result = measure_power(dumps, policy, dtypes, chosen, cases, kernel, progress)
    result["run"] = {
        "command": command,
        "dumps": dumps.url,
        "kernel": kernel,
        "policy": policy.source,
        "dtypes": dtypes,
        "grid": list(GRID),
        "bisect_steps": BISECT_STEPS,
        "seconds": time.perf_counter() - started,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    }
    write_json(result, report_dir / "power.json")
    (report_dir / "power.md").write_text(markdown(result))
    return result, missed(result)


def terminal_lines(result: dict[str, Any]) -> list[str]:
    header, body = table(result)
    return [*format_text_table(header, body), *baseline_lines(result), comparison_line(result)]
