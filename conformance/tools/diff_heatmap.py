"""The heatmap of one stage of `conformance diff`: its error over tokens × heads (a state: one panel per
sequence and head), against what decided the stage's verdict — the reference under the absolute gate,
the float64 truth under the relative gate, the precision contract's model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from conformance.judging.comparison import Comparison
from conformance.judging.verdict import MODE_GATES
from conformance.tools.diff import StageResult

if TYPE_CHECKING:
    from matplotlib.colors import LogNorm


def _ratio(actual: np.ndarray, against: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    actual = np.where(np.isfinite(actual), actual, np.inf).astype(np.float64)
    return np.abs(actual - against) / (atol + rtol * np.abs(against))


def shown_gate(c: Comparison) -> str:
    """The gate whose error a stage's heatmap shows: the first of its deciding gates (`MODE_GATES`) that
    fails (the absolute one with NaN/Inf), else the first that decides it."""
    deciding = MODE_GATES[c.judged_by]
    gates = {gate: ("finite", "absolute") if gate == "absolute" else (gate,) for gate in deciding}
    return next((gate for gate in deciding if not c.verdict.holds(*gates[gate])), deciding[0])


def judged_ratio(row: StageResult) -> tuple[np.ndarray, str]:
    """A compared stage's error, element by element, under the gate its heatmap shows (`shown_gate`),
    relative to that gate's bound; and its colour-bar label.

    absolute: |a - ref| / (atol + rtol·|ref|), > 1 fails; relative: |a - truth| / (atol + rtol·|truth|)
    over the relative gate's margin bound (factor × the reference's margin + floor), > 1 fails;
    contract: |a - model| / (max nRMSE · rms(model)), whose RMS over the result > 1 fails."""
    c, gate, checked = row.comparison, shown_gate(row.comparison), row.checked
    actual, tol = checked.sides.actual, c.measurement.tolerance
    if gate == "contract":
        rms = float(np.sqrt(np.mean(np.square(checked.model)))) or 1.0
        ratio = _ratio(actual, checked.model, c.contract.max_nrmse * rms, 0.0)
        return ratio, "|err vs contract model| / (max nRMSE·rms(model))   (RMS > 1 fails)"
    if gate == "relative":
        limits = c.attribution.limits
        bound = limits.factor * c.attribution.reference.margin + limits.margin_floor
        ratio = _ratio(actual, checked.truth, tol.atol, tol.rtol) / bound
        return ratio, "|err vs truth| / (atol + rtol·|truth|) / relative bound   (> 1 fails)"
    ratio = _ratio(actual, checked.sides.expected, tol.atol, tol.rtol)
    return ratio, "|err| / (atol + rtol·|ref|)   (> 1 fails)"


def is_state(row: StageResult) -> bool:
    """A recurrent state stage: axes seq × head × key × value."""
    axes = row.checked.sides.axes
    return axes[:1] == ("seq",) and len(axes) == 4


def heatmap_grid(row: StageResult) -> tuple[np.ndarray, tuple[str, str]]:
    """The error of a per-token stage relative to its deciding gate's bound (`judged_ratio`), reduced to
    2-D: (grid [x, y], axis names)."""
    ratio, _ = judged_ratio(row)
    # Keep the first two axes (token × head, token × channel), worst over the rest.
    grid = ratio.reshape(ratio.shape[0], ratio.shape[1], -1).max(axis=2)
    return grid, row.checked.sides.axes[:2]


def state_panels(row: StageResult) -> np.ndarray:
    """The error of a state stage relative to its deciding gate's bound (`judged_ratio`), worst over the
    sequences: [head, key, value]."""
    if not is_state(row):
        raise ValueError(f"{row.result}: not a state (axes {row.checked.sides.axes})")
    return judged_ratio(row)[0].max(axis=0)


def draw_heatmap(row: StageResult, path: Path, title: str, cu_seqlens: np.ndarray) -> None:
    """A PNG of the stage's error: over tokens × heads (tokens × channels for `out`), sequences marked;
    for a state, over key × value in one panel per head, worst over the sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = judged_ratio(row)[1]
    if is_state(row):
        sequences = row.checked.sides.actual.shape[0]
        figure = _draw_state(plt, state_panels(row), f"{title} (worst of {sequences} sequences)", label)
    else:
        figure = _draw_token_grid(plt, row, title, cu_seqlens, label)
    try:
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)


def _color_scale(values: np.ndarray) -> tuple[np.ndarray, LogNorm]:
    """Values clipped to [1e-4, top] and their log colour scale, whose top is at least 1 (the limit)."""
    from matplotlib.colors import LogNorm

    finite = np.where(np.isfinite(values), values, np.nan)
    top = max(float(np.nanmax(finite)) if np.isfinite(finite).any() else 1.0, 1.0)
    return np.clip(values, 1e-4, top), LogNorm(vmin=1e-4, vmax=top)


def _draw_token_grid(plt, row: StageResult, title: str, cu_seqlens: np.ndarray, label: str):
    from matplotlib.ticker import MaxNLocator

    grid, (x_axis, y_axis) = heatmap_grid(row)
    clipped, norm = _color_scale(grid)
    figure, axes = plt.subplots(figsize=(10, 4))
    image = axes.imshow(
        clipped.T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        norm=norm,
        cmap="magma",
    )
    if x_axis == "token":
        for boundary in cu_seqlens[1:-1]:
            axes.axvline(boundary - 0.5, color="cyan", linewidth=0.8)
    figure.colorbar(image, ax=axes, label=label)
    axes.set_xlabel(x_axis)
    axes.set_ylabel(y_axis)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title)
    figure.tight_layout()
    return figure


def _draw_state(plt, panels: np.ndarray, title: str, label: str):
    """One key × value panel per head, in rows of up to 8, on one shared log colour scale."""
    heads = panels.shape[0]
    columns = min(heads, 8)
    rows = -(-heads // columns)
    clipped, norm = _color_scale(panels)
    figure, grid = plt.subplots(
        rows, columns, figsize=(2.2 * columns + 1.5, 2.2 * rows + 0.8), squeeze=False, layout="constrained"
    )
    image = None
    for head, axes in enumerate(grid.flat):
        if head >= heads:
            axes.axis("off")
            continue
        image = axes.imshow(clipped[head], origin="lower", interpolation="nearest", norm=norm, cmap="magma")
        axes.set_title(f"head {head}: worst {panels[head].max():.3g}", fontsize=8)
        axes.set_xlabel("value", fontsize=7)
        axes.set_ylabel("key", fontsize=7)
        axes.tick_params(labelsize=6)
    figure.colorbar(image, ax=grid, label=label)
    figure.suptitle(title)
    return figure
