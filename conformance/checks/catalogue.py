"""The catalogue of checks: which ones a case gets, and the `CheckSpec` that names one of them.

A check is one result of the implementation under test against one reference, for one case and
dtype: the layer output or state, a kernel output or state on the dumped kernel inputs, an
intermediate, a prefill→decode or chunked-prefill replay, or a long case's output by position. What
each kind compares is its row of `conformance.checks.kinds`.
"""

from __future__ import annotations

import dataclasses

from conformance.checks import kinds, sequences
from conformance.checks.kinds import Check, CheckKind
from conformance.dumps.reader import CaseInfo, DumpSet
from kda_spec import dump_format as fmt


class CheckSkipped(Exception):
    """A check that cannot run here (nothing to compare with, or no such path in the adapter)."""


@dataclasses.dataclass(frozen=True, init=False)
class CheckSpec:
    """One check of one case (or serving scenario set) in one dtype; `check` is its name, `of` its
    kind and argument. Built from a `Check`, or from a check's name (read once, `kinds.parse_check`)."""

    case_id: str
    dtype: str
    check: str
    of: Check = dataclasses.field(compare=False, repr=False)

    def __init__(self, case_id: str, dtype: str, check: str | Check):
        of = kinds.parse_check(check) if isinstance(check, str) else check
        for name, value in (("case_id", case_id), ("dtype", dtype), ("check", of.name), ("of", of)):
            object.__setattr__(self, name, value)

    @property
    def id(self) -> str:
        return f"{self.case_id}-{self.dtype}-{self.check}"

    @property
    def kind(self) -> CheckKind:
        return self.of.kind

    @property
    def group(self) -> str:
        """The column of the summary table it belongs to."""
        return self.kind.group


def decode_runs(seq_lens: tuple[int, ...]) -> list[str]:
    """The decode runs of a case: k steps for each of `sequences.DECODE_STEPS`, and every token (`all`)
    for a case short enough."""
    runs = [f"k{k}" for k in sequences.DECODE_STEPS]
    return runs + (["all"] if max(seq_lens) <= sequences.DECODE_ALL_MAX_LEN else [])


def case_checks(seq_lens: tuple[int, ...]) -> list[Check]:
    """The checks a case of these sequence lengths gets, per dtype."""
    return [
        Check(kinds.LAYER),
        Check(kinds.LAYER_STATE),
        Check(kinds.LAYER_KERNEL_STATE),
        *(Check(kind) for kind in (*kinds.KERNEL_KINDS, *kinds.RAW_GATE_KERNEL_KINDS)),
        Check(kinds.KERNEL_CHUNK_CHECKPOINTS),
        *(Check(kinds.KERNEL_CHUNK_GRAD, name) for name in kinds.GRADIENT_INPUTS),
        Check(kinds.KERNEL_CHUNK_GRAD_H0),
        Check(kinds.KERNEL_CHUNK_CAUSAL),
        Check(kinds.KERNEL_CHUNK_GRAD_CAUSAL),
        Check(kinds.LAYER_GRAD_X),
        Check(kinds.LAYER_GRAD_H0),
        *(Check(kinds.LAYER_GRAD_WEIGHT, name) for name in kinds.LAYER_GRADIENT_WEIGHTS),
        Check(kinds.LAYER_CAUSAL),
        Check(kinds.LAYER_GRAD_CAUSAL),
        *(Check(kinds.INTERMEDIATE, name) for name in fmt.INTERMEDIATE_KEYS),
        *(Check(kind, run) for run in decode_runs(seq_lens) for kind in (kinds.DECODE, kinds.DECODE_SELF)),
        Check(kinds.CHUNKED_PREFILL),
        Check(kinds.CHUNKED_PREFILL_STATE),
    ]


def long_case_checks(info: CaseInfo) -> list[Check]:
    """The checks of a long case (group `long`): its output by position
    (conformance/judging/positions.py), and the whole prefill and its state, or the decode steps the
    case asks for."""
    if info.decode_steps:
        return [Check(kinds.DECODE, f"k{info.decode_steps}"), Check(kinds.BY_POSITION_DECODE)]
    return [Check(kinds.LAYER), Check(kinds.LAYER_STATE), Check(kinds.BY_POSITION_LAYER)]


def plan(dumps: DumpSet, case_ids: list[str], dtypes: list[str]) -> list[CheckSpec]:
    """Every check of the selected cases and dtypes, ordered by case, then dtype."""
    infos = {case_id: dumps.cases[case_id] for case_id in case_ids}
    return [
        CheckSpec(case_id, dtype, check)
        for case_id, info in infos.items()
        for dtype in dtypes
        for check in (long_case_checks(info) if info.group == fmt.LONG_GROUP else case_checks(info.seq_lens))
    ]
