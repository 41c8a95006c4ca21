"""The long cases' error by position, as files beside report.md: positions.json, positions.csv and, with
matplotlib, positions.png, and report.md's section on them (`conformance.judging.positions` measures
and judges the windows)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from conformance.judging.positions import PositionProfile, Window
from conformance.judging.verdict import worst_ratio
from conformance.reports.json_file import write_json
from kda_spec.extras import MissingExtra, require

JSON_FILE, CSV_FILE, PNG_FILE = "positions.json", "positions.csv", "positions.png"
POSITION_FILES = (JSON_FILE, CSV_FILE, PNG_FILE)


def window_row(window: Window, decode_from: int | None) -> dict[str, Any]:
    """One window's numbers, as positions.csv and positions.json hold them."""
    a = window.attribution
    return {
        "window_start": window.start,
        "window_end": window.end,
        "phase": "decode" if decode_from is not None and window.start >= decode_from else "prefill",
        "impl_worst": a.impl.max_abs,
        "impl_rms": window.impl_rms,
        "reference_worst": a.reference.max_abs,
        "reference_rms": window.reference_rms,
        "impl_margin": a.impl.margin,
        "reference_margin": a.reference.margin,
        "impl_nrmse": a.impl.nrmse,
        "reference_nrmse": a.reference.nrmse,
        "relative_ratio": worst_ratio(a.criteria),
        "passed": window.passed,
        "verdict": a.blame,
    }


def profile_record(p: PositionProfile) -> dict[str, Any]:
    return {
        "case": p.case_id,
        "dtype": p.dtype,
        "check": p.check,
        "window_tokens": p.window_tokens,
        "decode_from": p.decode_from,
        "limits": p.windows[0].attribution.limits.as_dict(),
        "passed": not p.failed,
        "windows": [window_row(window, p.decode_from) for window in p.windows],
    }


def write_files(profiles: list[PositionProfile], folder: Path) -> list[str]:
    """positions.json, positions.csv and (with matplotlib) positions.png in `folder`; returns the lines
    of report.md's section on them (none without profiles)."""
    if not profiles:
        return []
    payload = {"window_tokens": profiles[0].window_tokens, "profiles": [profile_record(p) for p in profiles]}
    write_json(payload, folder / JSON_FILE)
    rows = [{"case": p.case_id, "dtype": p.dtype, "check": p.check, **window_row(window, p.decode_from)}
            for p in profiles for window in p.windows]  # fmt: skip
    with (folder / CSV_FILE).open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        require("matplotlib", PNG_FILE)
    except MissingExtra as missing:
        picture = f"no {PNG_FILE}: {missing}."
    else:
        draw(profiles, folder / PNG_FILE)
        picture = f"![error by position]({PNG_FILE})"
    return markdown_lines(profiles, picture)


def markdown_lines(profiles: list[PositionProfile], picture: str) -> list[str]:
    """report.md's section: each long case's first and last window, and the worst under the gate."""
    lines = [
        "",
        "## Error by position (long cases)",
        "",
        f"Each side's error against the float64 truth per window of {profiles[0].window_tokens} tokens, "
        f"gated window by window with the relative gate (every window in `{CSV_FILE}` / `{JSON_FILE}`).",
        "",
        "| case | dtype | windows over | first window: impl worst / RMS, reference worst / RMS "
        "| last window: impl worst / RMS, reference worst / RMS | worst window (ratio to the gate) |",
        "|---|---|---|---|---|---|",
    ]
    for p in profiles:
        first, last, worst = p.windows[0], p.windows[-1], p.worst
        lines.append(
            f"| {p.case_id} | {p.dtype} | {len(p.failed)} of {len(p.windows)} | {_errors(first)} | "
            f"{_errors(last)} | {worst.start}-{worst.end} ({worst_ratio(worst.attribution.criteria):.3g}) |"
        )
    return [*lines, "", picture, ""]


def _errors(window: Window) -> str:
    a = window.attribution
    impl = f"{a.impl.max_abs:.3g} / {window.impl_rms:.3g}"
    return f"{impl}, {a.reference.max_abs:.3g} / {window.reference_rms:.3g}"


def draw(profiles: list[PositionProfile], path: Path) -> None:
    """One panel per long case and dtype: worst (solid) and RMS (dashed) error against the truth per
    window, implementation and reference, on a log scale; a dotted line where decoding starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(profiles), 1, figsize=(9, 3 * len(profiles)), squeeze=False)
    for ax, p in zip(axes[:, 0], profiles):
        centres = [(w.start + w.end) / 2 for w in p.windows]
        for side, colour in (("impl", "tab:blue"), ("reference", "tab:orange")):
            worst = [getattr(w.attribution, side).max_abs for w in p.windows]
            rms = [w.impl_rms if side == "impl" else w.reference_rms for w in p.windows]
            ax.plot(centres, worst, color=colour, label=f"{side} worst")
            ax.plot(centres, rms, color=colour, linestyle="--", label=f"{side} RMS")
        if p.decode_from is not None:
            ax.axvline(p.decode_from, color="grey", linestyle=":", label="decode starts")
        ax.set_yscale("log")
        ax.set_title(f"{p.case_id} {p.dtype}: |error| vs float64 truth per {p.window_tokens} tokens")
        ax.set_xlabel("token")
        ax.legend(fontsize="small", ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
