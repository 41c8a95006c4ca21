"""Where a bf16 stage departs from the precision contract: the rounding point at its entry, and what the
implementation does there instead.

The contract (docs/bf16-rounding.md, "The table") rounds to bf16 at numbered points; the stage `diff`
shows of each layer result is made at one of them. For the first stage off the contract (its
implementation against the contract's float64 model, `diff.first_leaving_contract`) this names that
point and tells, from the implementation's values, which of three it is: it leaves out a rounding the
contract makes (its values are not bf16), it rounds where the contract keeps fp32 (they are), or it
rounds as the contract does there from different values (a rounding before this point moved, or a
weight changed).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conformance.checks.kinds import parse_check
from conformance.tools.diff import StageResult, first_leaving_contract
from kda_spec.truth import bf16_rounded

CONTRACT_TABLE = "docs/bf16-rounding.md"
#: A stage whose values are bf16 values at least this often is taken as rounded to bf16 (an fp32 value
#: is one by chance about once in 2**16).
ROUNDED_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class RoundingPoint:
    """One rounding point of the contract's table: its number and stage there, whether the contract
    stores the result in bf16 (`rounds`) or keeps it fp32, and what it does, in words."""

    number: int
    name: str
    rounds: bool
    does: str

    def __str__(self) -> str:
        return f"rounding point {self.number} '{self.name}' ({CONTRACT_TABLE})"


CONV = RoundingPoint(
    3, "short conv + silu", True,
    "sums the conv in fp32 from the q, k, v projections rounded to bf16 (point 2), takes silu in fp32 and "
    "rounds its output once to bf16",
)  # fmt: skip
# The layer result each stage shows → the rounding point that makes it.
ROUNDING_POINTS = {
    "q_after_conv": CONV,
    "k_after_conv": CONV,
    "v_after_conv": CONV,
    "g": RoundingPoint(
        6, "decay gate g", False,
        "computes -exp(A_log)·softplus(f + dt_bias) in fp32 from f_a's and f_b's outputs rounded to bf16 "
        "(point 5) and keeps g fp32",
    ),
    "beta": RoundingPoint(
        7, "beta", False, "rounds b_proj's output to bf16, takes the sigmoid in fp32 and keeps beta fp32"
    ),
    "g_out": RoundingPoint(11, "output gate g_out", True, "rounds g_a's and g_b's outputs each to bf16"),
    "o_norm": RoundingPoint(
        12, "gated RMSNorm", True,
        "normalises the kernel output rounded to bf16 (point 10) in fp32 and rounds the gated norm once",
    ),
    "out": RoundingPoint(13, "o_proj", True, "sums o_proj in fp32 and rounds its output once to bf16"),
    "recurrent_state": RoundingPoint(9, "recurrent state", False, "keeps the recurrent state fp32"),
}  # fmt: skip


def bf16_share(values: np.ndarray) -> float:
    """The share of the finite `values` that are bf16 values (1 for none)."""
    finite = np.asarray(values, np.float32)
    finite = finite[np.isfinite(finite)]
    return float(np.mean(bf16_rounded(finite) == finite)) if finite.size else 1.0


def what_the_implementation_does(point: RoundingPoint, actual: np.ndarray, model: np.ndarray) -> str:
    """How the implementation's values of a stage (`actual`) differ from the contract's at `point`, in
    words: the rounding it leaves out, the one it adds, or the different values it rounds."""
    share = bf16_share(actual)
    rounded = share >= ROUNDED_SHARE
    percent = f"{100 * share:.1f}% of its values are bf16 values"
    if point.rounds and not rounded:
        return f"the implementation does not round here ({percent})"
    if not point.rounds and rounded:
        return f"the implementation rounds it to bf16 here, where the contract keeps fp32 ({percent})"
    differ = float(np.mean(np.asarray(actual, np.float64) != np.asarray(model, np.float64)))
    how = "rounds here as the contract does" if point.rounds else "keeps it fp32 as the contract does"
    return (
        f"the implementation {how}, but from different values ({100 * differ:.1f}% differ from the model's): "
        "a rounding before this point moved or was added, or a weight changed"
    )


def contract_lines(results: list[StageResult]) -> list[str]:
    """The first stage off the precision contract (in the layer's order), the rounding point at its
    entry and what the implementation does there; nothing when every stage holds the contract."""
    departing = first_leaving_contract(results)
    if departing is None:
        return []
    checked = departing.checked
    name = departing.key
    point = ROUNDING_POINTS.get(parse_check(departing.check).result)
    if point is None or checked.model is None:
        return [f"{name} departs from the contract's model; the contract names no rounding point for it"]
    return [
        f"{name} departs from the contract's model at {point}: the contract {point.does}; "
        + what_the_implementation_does(point, checked.sides.actual, checked.model)
    ]
