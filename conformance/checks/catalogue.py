"""The catalogue of checks: which ones a case gets, their names and groups.

A check is one result of the implementation under test against one reference, for one case and
dtype: the layer output or state, a kernel output or state on the dumped kernel inputs, an
intermediate, a prefill→decode or chunked-prefill replay, or a long case's output by position.
"""

from __future__ import annotations

import dataclasses

from conformance.checks import sequences
from conformance.dumps.reader import CaseInfo, DumpSet
from conformance.judging.positions import DECODE_POSITIONS, LAYER_POSITIONS
from kda_spec import dump_format as fmt

# Kernel checks: check name → (kernel path as in the dump keys, which result).
KERNEL_CHECKS = {
    "kernel-chunk": ("chunk", "o"),
    "kernel-chunk-state": ("chunk", "state"),
    "kernel-recurrent": ("fused_recurrent", "o"),
    "kernel-recurrent-state": ("fused_recurrent", "state"),
}
GROUPS = ("layer", "kernel", "intermediate", "decode", "chunked", "serving")


class CheckSkipped(Exception):
    """A check that cannot run here (nothing to compare with, or no such path in the adapter)."""


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    case_id: str
    dtype: str
    check: str

    @property
    def id(self) -> str:
        return f"{self.case_id}-{self.dtype}-{self.check}"

    @property
    def group(self) -> str:
        return group_of(self.check)


def group_of(check: str) -> str:
    """The column of the summary table a check belongs to."""
    if check in fmt.INTERMEDIATE_KEYS:
        return "intermediate"
    return next(group for group in GROUPS if check.startswith(group))


def case_checks(seq_lens: tuple[int, ...]) -> list[str]:
    """The names of the checks a case of these sequence lengths gets, per dtype."""
    decode_runs = [f"k{k}" for k in sequences.DECODE_STEPS]
    if max(seq_lens) <= sequences.DECODE_ALL_MAX_LEN:
        decode_runs.append("all")
    return [
        "layer",
        "layer-state",
        *KERNEL_CHECKS,
        *fmt.INTERMEDIATE_KEYS,
        *(f"decode-{run}{suffix}" for run in decode_runs for suffix in ("", "-self")),
        "chunked-prefill",
        "chunked-prefill-state",
    ]


def long_case_checks(info: CaseInfo) -> list[str]:
    """The checks of a long case (group `long`): its output by position
    (conformance/judging/positions.py), and the whole prefill and its state, or the decode steps the
    case asks for."""
    if info.decode_steps:
        return [f"decode-k{info.decode_steps}", DECODE_POSITIONS]
    return ["layer", "layer-state", LAYER_POSITIONS]


def plan(dumps: DumpSet, case_ids: list[str], dtypes: list[str]) -> list[CheckSpec]:
    """Every check of the selected cases and dtypes, ordered by case, then dtype."""
    infos = {case_id: dumps.cases[case_id] for case_id in case_ids}
    return [
        CheckSpec(case_id, dtype, check)
        for case_id, info in infos.items()
        for dtype in dtypes
        for check in (long_case_checks(info) if info.group == fmt.LONG_GROUP else case_checks(info.seq_lens))
    ]


def truth_name(check: str) -> str:
    """The stored truth a non-kernel check is judged against: the layer's output (decode and chunked
    prefill: its rows), its final recurrent state, or the intermediate of the check's name."""
    if check in fmt.INTERMEDIATE_KEYS:
        return check
    return "recurrent_state" if check.endswith("state") else "out"


def decode_run(check: str) -> int | None:
    """k of a `decode-k<k>[-self]` check; None for `decode-all[-self]`."""
    run = check.removeprefix("decode-").removesuffix("-self")
    return None if run == "all" else int(run[1:])
