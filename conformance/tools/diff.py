"""Stage by stage through the layer for one case: where does the error first leave tolerance?

conv (q/k/v_after_conv) → gate/beta (g, beta) → kernel (each kernel's output and final state on the
dumped inputs, the same of their raw-gate form on the dumped raw gate g_raw, the chunk kernel's
checkpoints, and the output on the layer's own) → norm (g_out, o_norm) → out → state (the layer's
final state) → chunked prefill (its output and the state it carries across calls). Each stage is
compared with the dump under the gate's tolerance. A final state that leaves tolerance while the
output it comes with holds is named first, as a state defect: a wrong state shows in the output only
of the tokens that come after it (a later call, or decode), which this case's output has not seen.

Where the dump carries the float64 truth, each stage shows three ways: implementation against
reference, implementation against the truth, reference against the truth, with the attribution; and
the first stage where the implementation's own error leaves the reference's is named.

The kernel stage on the layer's own inputs is the kernel output the layer itself computed where the
adapter returns it (intermediate `o_kda`), else the adapter's kernel rerun on the layer's conv outputs,
g and beta. A heatmap draws what decided the stage's verdict: its error against the reference under the
absolute gate, against the truth under the relative gate, against the precision contract's model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np

from conformance.adapters.guard import LAYER_KERNEL_OUTPUT
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.runner import CheckResult, CheckRunner, Sides
from conformance.checks.truth import KERNEL_INPUTS
from conformance.dumps.reader import CaseData
from conformance.judging.comparison import Comparison
from conformance.judging.verdict import unmet
from conformance.reports.check_record import summary
from conformance.reports.tables import format_text_table
from kda_spec import dump_format as fmt

LAYER_KERNEL_RERUN = "o_kda (the kernel on the layer's inputs)"
LAYER_KERNEL_OWN = "o_kda (the layer's own kernel output)"
#: A scale error is named when the best scale of the reference leaves at most this share of the error.
SCALE_RESIDUAL_SHARE = 0.1
# (stage, result shown, check whose computation and tolerance it uses); an intermediate is its own check.
STAGES = (
    *(("conv", name, name) for name in ("q_after_conv", "k_after_conv", "v_after_conv")),
    *(("gate/beta", name, name) for name in ("g", "beta")),
    ("kernel", "o_kda_chunk (dumped inputs)", "kernel-chunk"),
    ("kernel", "recurrent_state_chunk (dumped inputs)", "kernel-chunk-state"),
    ("kernel", "o_kda_fused_recurrent (dumped inputs)", "kernel-recurrent"),
    ("kernel", "recurrent_state_fused_recurrent (dumped inputs)", "kernel-recurrent-state"),
    ("kernel", "o_kda_chunk_rawgate (g_raw)", "kernel-chunk-rawgate"),
    ("kernel", "recurrent_state_chunk_rawgate (g_raw)", "kernel-chunk-rawgate-state"),
    ("kernel", "o_kda_fused_recurrent_rawgate (g_raw)", "kernel-recurrent-rawgate"),
    ("kernel", "recurrent_state_fused_recurrent_rawgate (g_raw)", "kernel-recurrent-rawgate-state"),
    ("kernel", "chunk_checkpoints (dumped inputs, every chunk's start)", "kernel-chunk-checkpoints"),
    ("kernel", LAYER_KERNEL_RERUN, None),
    *(("norm", name, name) for name in ("g_out", "o_norm")),
    ("out", "out", "layer"),
    ("state", "layer_state (the layer's final state)", "layer-state"),
    ("state", "layer_kernel_state (the final state on its own kernel inputs)", "layer-kernel-state"),
    ("chunked prefill", "chunked_out (the case in pieces)", "chunked-prefill"),
    ("chunked prefill", "chunked_state (carried across the pieces)", "chunked-prefill-state"),
)
# A state check → (the output check it comes with, what the state is, in words).
STATE_OF_OUTPUT = {
    "kernel-chunk-state": ("kernel-chunk", "the chunk kernel's final state"),
    "kernel-recurrent-state": ("kernel-recurrent", "the recurrent kernel's final state"),
    "kernel-chunk-rawgate-state": ("kernel-chunk-rawgate", "the raw-gate chunk kernel's final state"),
    "kernel-recurrent-rawgate-state": (
        "kernel-recurrent-rawgate",
        "the raw-gate recurrent kernel's final state",
    ),
    "kernel-chunk-checkpoints": (
        "kernel-chunk",
        "the chunk kernel's checkpoints (its state entering every chunk)",
    ),
    "layer-state": ("layer", "the layer's final state"),
    "layer-kernel-state": ("layer", "the layer's final state on its own kernel inputs"),
    "chunked-prefill-state": ("chunked-prefill", "chunked prefill's carried state"),
}


@dataclasses.dataclass
class StageResult:
    """One stage: the check it was judged as (its sides, comparison, truth and model), or why not."""

    stage: str
    result: str
    check: str | None = None
    checked: CheckResult | None = None
    skipped: str = ""

    @property
    def key(self) -> str:
        """Short name to pick a stage with (`--stage`): the result name without its note."""
        return self.result.split(" ")[0]

    @property
    def comparison(self) -> Comparison | None:
        return None if self.checked is None else self.checked.comparison


def run_stages(runner: CheckRunner, case_id: str, dtype: str) -> list[StageResult]:
    """Every stage of one case and dtype, compared with the dump (skipped where either side lacks it)."""
    case = runner.case(case_id)
    results = []
    for stage, result, check in STAGES:
        row = StageResult(stage, result, check)
        try:
            if check is None:
                sides, row.check, row.result = _kernel_on_layer_inputs(runner, case, dtype)
                truth = functools.partial(runner.layer_kernel_truth, case, dtype)
                row.checked = runner.judge(case, CheckSpec(case_id, dtype, row.check), sides, truth)
            else:
                spec = CheckSpec(case_id, dtype, check)
                row.checked = runner.judge(case, spec, runner.sides(case, spec))
        except CheckSkipped as skip:
            row.skipped = str(skip)
        results.append(row)
    return results


def _kernel_on_layer_inputs(runner: CheckRunner, case: CaseData, dtype: str) -> tuple[Sides, str, str]:
    """The kernel output inside the layer: the one the layer computed where the adapter returns it
    (`o_kda`), else the reference layer's kernel run on this implementation's own conv outputs, g and
    beta; against the reference, with the check whose tolerance applies and which of the two it is."""
    path = case.info.layer_kernel_path
    reference = case.result(f"o_kda_{path}", dtype)
    if reference is None:
        raise CheckSkipped(f"the dump has no {fmt.result_key(f'o_kda_{path}', dtype)!r}")
    check = "kernel-chunk" if path == "chunk" else "kernel-recurrent"
    axes = ("token", "head", "channel")
    stages = runner.calls.layer(case, dtype).intermediates
    if LAYER_KERNEL_OUTPUT in stages:
        return Sides(stages[LAYER_KERNEL_OUTPUT], reference, axes), check, LAYER_KERNEL_OWN
    missing = [name for name in KERNEL_INPUTS if name not in stages]
    if missing:
        raise CheckSkipped(f"the adapter returns no 'o_kda' and does not expose {missing}")
    o, _ = runner.calls.run_kernel(case, dtype, path, stages)
    return Sides(o, reference, axes), check, LAYER_KERNEL_RERUN


def _first_stage(results: list[StageResult], test: Callable[[Comparison], object]) -> StageResult | None:
    """The first stage (in the layer's order) compared, whose comparison passes `test`."""
    return next((row for row in results if row.comparison is not None and test(row.comparison)), None)


def first_out_of_tolerance(results: list[StageResult]) -> StageResult | None:
    """The first stage out of tolerance, in the order of the layer."""
    return _first_stage(results, lambda c: not c.passed)


def state_defects(results: list[StageResult]) -> list[tuple[StageResult, str]]:
    """The state stages out of tolerance while their output stage holds, each with what it is in words."""
    outputs = {row.check: row.comparison for row in results}
    return [
        (row, STATE_OF_OUTPUT[row.check][1])
        for row in results
        if row.check in STATE_OF_OUTPUT
        and row.comparison is not None
        and not row.comparison.passed
        and (output := outputs.get(STATE_OF_OUTPUT[row.check][0])) is not None
        and output.passed
    ]


def stage_to_look_at(results: list[StageResult]) -> StageResult | None:
    """The stage to draw by default: the first state defect, else the first stage out of tolerance."""
    defects = state_defects(results)
    return defects[0][0] if defects else first_out_of_tolerance(results)


def first_leaving_reference(results: list[StageResult]) -> StageResult | None:
    """The first stage where the implementation's own error against the truth leaves the reference's:
    beyond the relative gate's factor and floor."""
    return _first_stage(results, lambda c: c.attribution is not None and not c.verdict.holds("relative"))


def _against_truth(c: Comparison) -> list[str]:
    """impl vs truth, reference vs truth (margin / nRMSE each), and the attribution: n/a without truth."""
    a = c.attribution
    if a is None:
        return ["n/a", "n/a", "n/a"]
    return [f"{side.margin:.3g} / {side.nrmse:.3g}" for side in (a.impl, a.reference)] + [a.blame]


def _against_contract(c: Comparison) -> str:
    """The implementation against the bf16 precision contract's model (nRMSE / gain): empty without one."""
    if c.contract is None:
        return ""
    text = f"{c.contract.impl.nrmse:.3g} / {c.contract.impl.gain:+.2g}"
    if not c.verdict.holds("contract"):
        return f"{text} OUT"
    return f"{text} exempt" if c.contract.gating.applies and c.contract.closer else text


def first_leaving_contract(results: list[StageResult]) -> StageResult | None:
    """The first stage (in the layer's order) whose implementation fails the precision contract."""
    return _first_stage(results, lambda c: c.contract is not None and not c.verdict.holds("contract"))


def table_lines(results: list[StageResult], failing_outside: Sequence[str] = ()) -> list[str]:
    """The three-way table: per stage, implementation against reference (the gate's numbers and
    verdict), implementation against the float64 truth, reference against the truth, attribution; and
    what it finds. `failing_outside`: the case's failing checks the table does not show, named where no
    stage is out of tolerance."""
    header = [
        "stage",
        "result",
        "max abs",
        "max rel",
        "margin",
        "nRMSE",
        "verdict",
        "impl vs truth",
        "ref vs truth",
        "attribution",
        "impl vs contract",
        "worst at",
    ]
    body = []
    for row in results:
        c = row.comparison
        if c is None:
            body.append([row.stage, row.result, "", "", "", "", "skip", "", "", "", "", row.skipped])
            continue
        m = c.measurement
        where = ", ".join(f"{axis} {i}" for axis, i in m.worst.get("index", {}).items())
        verdict = "ok" if c.passed else "OUT"
        numbers = [f"{value:.3g}" for value in (m.max_abs, m.max_rel, m.margin, m.nrmse)]
        body.append(
            [row.stage, row.result, *numbers, verdict, *_against_truth(c), _against_contract(c), where]
        )
    lines = format_text_table(header, body)
    lines.append(
        "margin / nRMSE: against the reference under the check's tolerance; impl and ref vs truth: "
        "each side against the float64 truth, margin / nRMSE (n/a: the dump has no truth for it); impl vs "
        "contract (bf16): nRMSE / gain against the float64 model of the precision contract's roundings"
    )
    for row, what in state_defects(results):
        lines.append(
            f"state defect: {what} ({row.key}) leaves tolerance while its output holds: "
            f"{summary(row.comparison)}"
        )
    first = first_out_of_tolerance(results)
    if first is None and failing_outside:
        lines.append(
            "no stage compared is out of tolerance, but the case fails outside the stage table: "
            + ", ".join(failing_outside)
        )
    elif first is None:
        lines.append("every stage compared holds")
    else:
        lines.append(f"first out of tolerance: {first.stage} ({first.result}): {summary(first.comparison)}")
        scale = scale_error(first)
        if scale is not None:
            factor, along = scale
            lines.append(
                f"  a scale error: {first.key} is {factor:.4g} × the reference "
                f"({100 * along:.1f}% of the squared error lies along it)"
            )
    lines.append(_leaving_line(results))
    diagnosed = _first_stage(results, lambda c: c.matmul_diagnosis)
    if diagnosed is not None:
        lines.append(
            f"likely cause, from {diagnosed.stage} ({diagnosed.result}) on: "
            f"{diagnosed.comparison.matmul_diagnosis.text()}"
        )
    departing = first_leaving_contract(results)
    if departing is not None:
        lines.append(
            f"first stage off the precision contract: {departing.stage} ({departing.result}): "
            + "; ".join(unmet(departing.comparison.verdict.of("contract")))
        )
    return lines


def _leaving_line(results: list[StageResult]) -> str:
    """Where the implementation's own error against the truth first leaves the reference's, in words."""
    with_truth = [row for row in results if row.comparison is not None and row.comparison.attribution]
    if not with_truth:
        return "no stage has a float64 truth in this dump: the implementation's own error is not known"
    leaving = first_leaving_reference(results)
    if leaving is None:
        return (
            f"the implementation's own error stays within the relative bound of the reference's at every "
            f"stage with a truth ({len(with_truth)} of {len(results)})"
        )
    reasons = "; ".join(unmet(leaving.comparison.verdict.of("relative")))
    where = f"{leaving.stage} ({leaving.result})"
    return f"the implementation's own error first leaves the reference's at {where}: {reasons}"


def scale_error(row: StageResult) -> tuple[float, float] | None:
    """(s, share) when a compared stage's error is mostly a scale: the result is close to s × the
    reference, the best such s leaving at most `SCALE_RESIDUAL_SHARE` of the error's norm, and `share` of
    the squared error lies along the reference; None otherwise (or with a NaN/Inf in the result)."""
    sides = row.checked.sides
    a, b = (np.asarray(x, np.float64).ravel() for x in (sides.actual, sides.expected))
    error_norm2, reference_norm2 = float(np.sum((a - b) ** 2)), float(b @ b)
    if not np.all(np.isfinite(a)) or error_norm2 == 0 or reference_norm2 == 0:
        return None
    factor = float(a @ b) / reference_norm2
    left = float(np.sum((a - factor * b) ** 2)) / error_norm2
    return (factor, 1 - left) if left <= SCALE_RESIDUAL_SHARE**2 else None
