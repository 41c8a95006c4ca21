"""A failing decode or chunked-prefill check, call by call: the step where it departs, and its stages there.

A decode of token t after the prefill of the tokens before it must give what the whole prefill gives
at row t, output and intermediates alike; a piece of a chunked prefill, what the whole prefill gives
at the piece's rows. So the check's run is repeated one call at a time (`ImplementationCalls.
decode_steps`, `.chunked_prefill_steps`: each decode step after the prefill, or each piece), each
call's output is judged against the reference's rows of its tokens under the check's own tolerance and
gate mode, and the first call whose output leaves tolerance is named. At that call every stage the
adapter returns (the intermediates of `diff.STAGES`, the kernel output `o_kda`, the output) is judged
against the reference's same rows, as `diff`'s stage table. Where the adapter returns no intermediates
from that call, the walk shows the output per call only, and says so.

Which kinds are walked, and how, is `WALKS`: a kind not in it is decided, not walked (a chunked
prefill's carried state among them: the dump has the state after the last piece only).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from conformance.adapter import LayerResult
from conformance.adapters.guard import LAYER_KERNEL_OUTPUT
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.kinds import HEAD_AXES, CheckKind, parse_check
from conformance.checks.runner import CheckResult, CheckRunner, Sides
from conformance.dumps.reader import CaseData
from conformance.reports.check_record import summary
from conformance.reports.tables import format_text_table
from conformance.tools.diff import LAYER_KERNEL_OWN, STAGES, StageResult

#: The calls shown before the first that departs (the rest of them are counted).
SHOWN_BEFORE = 3


@dataclasses.dataclass
class Step:
    """One call of the check's run: its label, the case's token positions of its rows, and its output
    judged against the reference's rows (or why not)."""

    label: str
    positions: np.ndarray
    result: LayerResult
    checked: CheckResult | None = None
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return self.checked is None or self.checked.comparison.passed


@dataclasses.dataclass
class StepWalk:
    """A check's run call by call: each call (`steps`), the one named (`named`: the first whose output
    leaves tolerance, else the one closest to its limit), its stage table (`stages`; empty with
    `no_stages` saying why), what the check compares with (`reference`), and the other failing checks
    whose run is this very one (`same_run`: `decode-k8` and `decode-all` of a case of 8 tokens)."""

    check: str
    method: str
    reference: str
    steps: list[Step]
    named: Step | None = None
    departs: bool = False
    stages: list[StageResult] = dataclasses.field(default_factory=list)
    no_stages: str = ""
    same_run: list[str] = dataclasses.field(default_factory=list)

    def runs_as(self, other: StepWalk) -> bool:
        """Whether `other` walks the same calls against the same reference."""
        return self.reference == other.reference and [s.positions.tolist() for s in self.steps] == [
            s.positions.tolist() for s in other.steps
        ]


# A reference of the whole case: the result of that (dump) name, or None where there is none.
Reference = Callable[[str], np.ndarray | None]


def walk(runner: CheckRunner, spec: CheckSpec) -> StepWalk | None:
    """The check `spec` call by call, for a kind in `WALKS`; None for any other kind."""
    walker = WALKS.get(spec.kind)
    if walker is None:
        return None
    return walker(runner, runner.case(spec.case_id), spec)


def _decode_walk(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> StepWalk:
    """A decode check's run step by step (after the prefill of the rest, one token of each sequence
    still decoding), against the dump's rows (a `-self` check: its own prefill's) of the same tokens."""
    steps = spec.of.decode_steps if spec.of.arg is not None else case.info.decode_steps
    calls = runner.calls.decode_steps(case, spec.dtype, steps)
    if spec.kind is kinds.DECODE_SELF:
        own = runner.calls.layer(case, spec.dtype)
        reference, said = functools.partial(_own, own), "its own prefill of the whole case"
    else:
        reference, said = functools.partial(_dumped, case, spec.dtype), "the dump"
    labels = [f"step {i}" for i in range(len(calls))]
    return _walked(runner, case, spec, spec, calls, labels, reference, "layer_decode", said)


def _chunked_walk(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> StepWalk:
    """A chunked prefill's run piece by piece, against the dump's rows of each piece."""
    calls = runner.calls.chunked_prefill_steps(case, spec.dtype)
    labels = [f"piece {i}" for i in range(len(calls))]
    reference = functools.partial(_dumped, case, spec.dtype)
    return _walked(runner, case, spec, spec, calls, labels, reference, "layer_extend", "the dump")


WALKS: dict[CheckKind, Callable[[CheckRunner, CaseData, CheckSpec], StepWalk]] = {
    kinds.DECODE: _decode_walk,
    kinds.DECODE_SELF: _decode_walk,
    kinds.BY_POSITION_DECODE: _decode_walk,
    kinds.CHUNKED_PREFILL: _chunked_walk,
}


def _dumped(case: CaseData, dtype: str, name: str) -> np.ndarray | None:
    """The dump's result `name` of the `dtype` run (the kernel output inside the layer: the dump's of
    the layer's kernel path)."""
    if name == LAYER_KERNEL_OUTPUT:
        name = f"o_kda_{case.info.layer_kernel_path}"
    return case.result(name, dtype)


def _own(prefill: LayerResult, name: str) -> np.ndarray | None:
    """The implementation's own prefill of the whole case, result `name`."""
    return np.asarray(prefill.out) if name == "out" else prefill.intermediates.get(name)


def _walked(
    runner: CheckRunner,
    case: CaseData,
    spec: CheckSpec,
    out_spec: CheckSpec,
    calls: list[tuple[np.ndarray, LayerResult]],
    labels: list[str],
    reference: Reference,
    method: str,
    said: str,
) -> StepWalk:
    """Each call's output judged as `out_spec`; the first that departs (else the one nearest its limit)
    named, with its stage table."""
    steps = [Step(label, positions, result) for label, (positions, result) in zip(labels, calls)]
    walked = StepWalk(spec.check, method, said, steps)
    expected = reference("out")
    for step in walked.steps:
        try:
            step.checked = _judged(
                runner, case, out_spec, step.result.out, expected, step.positions, out_spec.kind.axes
            )
        except CheckSkipped as skip:
            step.skipped = str(skip)
    judged = [step for step in walked.steps if step.checked is not None]
    departing = next((step for step in judged if not step.passed), None)
    walked.departs = departing is not None
    walked.named = departing or max(judged, key=lambda s: s.checked.comparison.gate_ratio, default=None)
    if walked.named is not None:
        walked.stages = _stages(runner, case, out_spec, walked.named, reference, method)
        if not any(row.key in walked.named.result.intermediates for row in walked.stages):
            walked.no_stages = f"the adapter's {method} returns no intermediates: the output per call only"
            walked.stages = []
    return walked


def _judged(
    runner: CheckRunner,
    case: CaseData,
    spec: CheckSpec,
    actual: np.ndarray,
    whole: np.ndarray | None,
    positions: np.ndarray,
    axes: tuple[str, ...],
    truth: Callable[[], tuple[np.ndarray, str]] | None = None,
) -> CheckResult:
    """`actual`, the rows `positions` of a call, against the reference's same rows (`whole`: of the
    whole case), judged as `spec`."""
    if whole is None:
        raise CheckSkipped(f"the dump has no {spec.of.result!r} to compare with")
    sides = Sides(np.asarray(actual), whole[positions], axes[: whole.ndim], {"token": positions})
    return runner.judge(case, spec, sides, truth)


def _stages(
    runner: CheckRunner, case: CaseData, out_spec: CheckSpec, step: Step, reference: Reference, method: str
) -> list[StageResult]:
    """The stages of `diff.STAGES` one call gives (its intermediates, its kernel output, its output),
    each against the reference's rows of the call's tokens."""
    rows = []
    for stage, result, check in STAGES:
        kind = None if check is None else parse_check(check).kind
        if kind not in (None, kinds.INTERMEDIATE, kinds.LAYER):
            continue
        row = StageResult(stage, result, check)
        try:
            if kind is kinds.LAYER:
                row.check, row.checked = out_spec.check, step.checked
            elif kind is None:
                row.result = LAYER_KERNEL_OWN
                row.check, row.checked = _kernel_row(runner, case, out_spec, step, reference)
            else:
                spec = CheckSpec(out_spec.case_id, out_spec.dtype, check)
                row.checked = _judged(runner, case, spec, _returned(step, result, method), reference(result),
                                      step.positions, HEAD_AXES)  # fmt: skip
        except CheckSkipped as skip:
            row.skipped = str(skip)
        rows.append(row)
    return rows


def _kernel_row(
    runner: CheckRunner, case: CaseData, out_spec: CheckSpec, step: Step, reference: Reference
) -> tuple[str, CheckResult]:
    """The kernel output inside the layer at one call (`o_kda`, where the adapter returns it) under the
    tolerance of the layer's kernel path, against the float64 recurrence on the truth's inputs at the
    call's tokens; with the check it is judged as."""
    path = case.info.layer_kernel_path
    check = "kernel-chunk" if path == "chunk" else "kernel-recurrent"
    actual = step.result.intermediates.get(LAYER_KERNEL_OUTPUT)
    if actual is None:
        raise CheckSkipped(f"the adapter returns no {LAYER_KERNEL_OUTPUT!r}")

    def truth() -> tuple[np.ndarray, str]:
        o, source = runner.layer_kernel_truth(case, out_spec.dtype)
        return o[step.positions], source

    spec = CheckSpec(out_spec.case_id, out_spec.dtype, check)
    whole = reference(LAYER_KERNEL_OUTPUT)
    return check, _judged(runner, case, spec, actual, whole, step.positions, HEAD_AXES, truth)


def _returned(step: Step, name: str, method: str) -> np.ndarray:
    """Intermediate `name` of one call; `CheckSkipped` where the adapter does not return it."""
    value = step.result.intermediates.get(name)
    if value is None:
        raise CheckSkipped(f"the adapter's {method} returns no {name!r}")
    return value


def step_lines(walked: StepWalk) -> list[str]:
    """The walk: the output of each call (the calls long before the named one counted, not shown), the
    call named, and why its stage table follows or does not."""
    steps = walked.steps
    shown_from = max(0, steps.index(walked.named) - SHOWN_BEFORE) if walked.named else 0
    same = f" (and {', '.join(walked.same_run)}: the same calls)" if walked.same_run else ""
    lines = [f"{walked.check}{same}, call by call, against {walked.reference} at the same tokens:"]
    body = []
    for step in steps[shown_from : steps.index(walked.named) + 1 if walked.named else len(steps)]:
        tokens = ", ".join(map(str, step.positions[:8])) + (", …" if len(step.positions) > 8 else "")
        if step.checked is None:
            body.append([step.label, tokens, "", "", "skip", step.skipped])
            continue
        m = step.checked.comparison.measurement
        verdict = "ok" if step.passed else "OUT"
        body.append(
            [
                step.label,
                tokens,
                f"{m.max_abs:.3g}",
                f"{m.nrmse:.3g}",
                verdict,
                summary(step.checked.comparison),
            ]
        )
    if shown_from:
        earlier = f"{steps[0].label} to {steps[shown_from - 1].label}" if shown_from > 1 else steps[0].label
        lines.append(f"  {shown_from} earlier call{'s' if shown_from > 1 else ''} ({earlier}) hold")
    lines += [
        "  " + line for line in format_text_table(["call", "tokens", "max abs", "nRMSE", "verdict", ""], body)
    ]
    named = walked.named
    if named is None:
        lines.append("  no call could be compared")
        return lines
    after = steps[steps.index(named) + 1 :]
    if after:
        out = sum(not step.passed for step in after)
        calls = f"{len(after)} more call{'s' if len(after) > 1 else ''}"
        lines.append(f"  after it: {calls}, {out} of {'them' if len(after) > 1 else 'it'} out of tolerance")
    if walked.departs:
        lines.append(f"first call out of tolerance: {named.label} ({_tokens(named)})")
    else:
        lines.append(
            "no call leaves tolerance on its own (the check fails over its calls together); the nearest "
            f"its limit: {named.label} ({_tokens(named)})"
        )
    if walked.no_stages:
        lines.append(walked.no_stages)
    return lines


def _tokens(step: Step) -> str:
    """The case's tokens of one call, in words: `token 60`, `tokens 3, 40`, `12 tokens`."""
    positions = step.positions
    if len(positions) == 1:
        return f"token {positions[0]}"
    return f"tokens {', '.join(map(str, positions))}" if len(positions) <= 8 else f"{len(positions)} tokens"
