"""Stage by stage through the layer for one case: where does the error first leave tolerance?

conv (q/k/v_after_conv) → gate/beta (g, beta) → kernel (on the dumped inputs, and on the layer's
own) → norm (g_out, o_norm) → out. Each stage is compared with the dump under the gate's tolerance.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from conformance.checks import KERNEL_INPUTS, CheckRunner, CheckSkipped, CheckSpec
from conformance.metrics import Comparison, compare
from conformance.reader import CaseData
from conformance.report import format_text_table
from kda_spec import dump_format as fmt

# (stage, result shown, check whose computation and tolerance it uses)
STAGES = (
    ("conv", "q_after_conv", "q_after_conv"),
    ("conv", "k_after_conv", "k_after_conv"),
    ("conv", "v_after_conv", "v_after_conv"),
    ("gate/beta", "g", "g"),
    ("gate/beta", "beta", "beta"),
    ("kernel", "o_kda_chunk (dumped inputs)", "kernel-chunk"),
    ("kernel", "o_kda_fused_recurrent (dumped inputs)", "kernel-recurrent"),
    ("kernel", "o_kda (the layer's inputs)", None),
    ("norm", "g_out", "g_out"),
    ("norm", "o_norm", "o_norm"),
    ("out", "out", "layer"),
)


@dataclasses.dataclass
class StageResult:
    stage: str
    result: str
    comparison: Comparison | None = None
    skipped: str = ""
    actual: np.ndarray | None = None
    expected: np.ndarray | None = None
    axes: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Short name to pick a stage with (`--stage`): the result name without its note."""
        return self.result.split(" ")[0]


def run_stages(runner: CheckRunner, case_id: str, dtype: str) -> list[StageResult]:
    """Every stage of one case and dtype, compared with the dump (skipped where either side lacks it)."""
    case = runner.case(case_id)
    results = []
    for stage, result, check in STAGES:
        row = StageResult(stage, result)
        try:
            if check is None:
                row.actual, row.expected, row.axes, check = _kernel_on_layer_inputs(runner, case, dtype)
            else:
                row.actual, row.expected, row.axes, _ = runner.pair(case, CheckSpec(case_id, dtype, check))
            row.actual = np.asarray(row.actual)
            row.comparison = compare(
                row.actual,
                row.expected,
                runner.policy.tolerance(check, dtype),
                runner.policy.rfc[dtype],
                row.axes,
            )
        except CheckSkipped as skip:
            row.skipped = str(skip)
        results.append(row)
    return results


def _kernel_on_layer_inputs(
    runner: CheckRunner, case: CaseData, dtype: str
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], str]:
    """The kernel the reference layer used, run on this implementation's own conv outputs, g and beta."""
    path = case.info.layer_kernel_path
    stages = runner.layer(case, dtype).intermediates
    missing = [name for name in KERNEL_INPUTS if name not in stages]
    if missing:
        raise CheckSkipped(f"the adapter does not expose {missing}")
    reference = case.result(f"o_kda_{path}", dtype)
    if reference is None:
        raise CheckSkipped(f"the dump has no {fmt.result_key(f'o_kda_{path}', dtype)!r}")
    o, _ = runner.run_kernel(case, dtype, path, stages)
    check = "kernel-chunk" if path == "chunk" else "kernel-recurrent"
    return o, reference, ("token", "head", "channel"), check


def first_out_of_tolerance(results: list[StageResult]) -> StageResult | None:
    return next((row for row in results if row.comparison is not None and not row.comparison.passed), None)


def table_lines(results: list[StageResult]) -> list[str]:
    header = ["stage", "result", "max abs", "max rel", "margin", "nRMSE", "verdict", "worst at"]
    body = []
    for row in results:
        c = row.comparison
        if c is None:
            body.append([row.stage, row.result, "", "", "", "", "skip", row.skipped])
            continue
        where = ", ".join(f"{axis} {i}" for axis, i in c.worst.get("index", {}).items())
        verdict = "ok" if c.passed else "OUT"
        numbers = [f"{value:.3g}" for value in (c.max_abs, c.max_rel, c.margin, c.nrmse)]
        body.append([row.stage, row.result, *numbers, verdict, where])
    lines = format_text_table(header, body)
    first = first_out_of_tolerance(results)
    if first is None:
        lines.append("every stage compared holds")
    else:
        lines.append(f"first out of tolerance: {first.stage} ({first.result}): {first.comparison.summary()}")
    return lines


def heatmap_grid(row: StageResult) -> tuple[np.ndarray, tuple[str, str]]:
    """The error of a stage relative to its tolerance, reduced to 2-D: (grid [x, y], axis names)."""
    tol = row.comparison.tolerance
    actual = np.where(np.isfinite(row.actual), row.actual, np.inf).astype(np.float64)
    ratio = np.abs(actual - row.expected) / (tol.atol + tol.rtol * np.abs(row.expected))
    # Keep the first two axes (token × head, token × channel, seq × head), worst over the rest.
    grid = ratio.reshape(ratio.shape[0], ratio.shape[1], -1).max(axis=2)
    return grid, (row.axes[0], row.axes[1])


def draw_heatmap(row: StageResult, path: Path, title: str, cu_seqlens: np.ndarray) -> None:
    """A PNG of the stage's error over tokens × heads (tokens × channels for `out`), sequences marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    grid, (x_axis, y_axis) = heatmap_grid(row)
    finite = np.where(np.isfinite(grid), grid, np.nan)
    top = max(float(np.nanmax(finite)) if np.isfinite(finite).any() else 1.0, 1.0)
    figure, axes = plt.subplots(figsize=(10, 4))
    image = axes.imshow(
        np.clip(grid, 1e-4, top).T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        norm=LogNorm(vmin=1e-4, vmax=top),
        cmap="magma",
    )
    if x_axis == "token":
        for boundary in cu_seqlens[1:-1]:
            axes.axvline(boundary - 0.5, color="cyan", linewidth=0.8)
    figure.colorbar(image, ax=axes, label="|err| / (atol + rtol·|ref|)   (> 1 fails)")
    axes.set_xlabel(x_axis)
    axes.set_ylabel(y_axis)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
