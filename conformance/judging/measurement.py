"""One result against its reference, measured: the numbers every check records, before any verdict,
and the minimum-tokens rule of the whole-output statistics."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance.judging.limits import Tolerance
from conformance.judging.verdict import Criterion


@dataclasses.dataclass(frozen=True)
class MinTokensRule:
    """The policy's minimum-tokens rule on one result: a whole-output statistic held to a fixed limit
    (the bf16 gate's nRMSE, the precision contract's nRMSE and gain) decides over the `rows` of the
    result's leading axis that at least `min_tokens` tokens produced, and decides at all where `tokens`
    (a per-token result's rows; a per-sequence one's longest sequence) reaches `min_tokens`."""

    rows: np.ndarray  # bool, one per entry of the leading axis
    tokens: int
    min_tokens: int

    @property
    def applies(self) -> bool:
        return self.tokens >= self.min_tokens

    def criterion_fields(self) -> dict[str, int]:
        """The criterion fields that carry the rule."""
        return {"tokens": self.tokens, "min_tokens": self.min_tokens}


def min_tokens_rule(
    axes: tuple[str, ...], rows: int, seq_lens: Sequence[int] | None, min_tokens: int
) -> MinTokensRule:
    """The minimum-tokens rule for a result of `rows` entries along its leading axis `axes[0]`: a
    per-token result (`token`) counts its rows, and applies whole; a per-sequence one (`seq`: states)
    counts each sequence's own tokens (`seq_lens`) and applies over the sequences long enough; any other
    result is one whole output the rule lets through."""
    if axes[:1] == ("seq",) and seq_lens is not None:
        if len(seq_lens) != rows:
            raise ValueError(f"{len(seq_lens)} sequence lengths for a result of {rows} sequences")
        lens = np.asarray(seq_lens, np.int64)
        return MinTokensRule(lens >= min_tokens, int(lens.max()), min_tokens)
    tokens = rows if axes[:1] == ("token",) else min_tokens
    return MinTokensRule(np.full(rows, tokens >= min_tokens), tokens, min_tokens)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One result against its reference under one tolerance: the numbers, before any verdict.

    margin: worst `|a - b| / (atol + rtol * |b|)` (<= 1 is within the tolerance element-wise);
    nrmse: fla's normalised RMSE `‖a - b‖₂ / ‖b‖₂`; worst: the element that sets the margin.
    gating: the minimum-tokens rule on the result (`min_tokens_rule`); gated_nrmse: the nRMSE over the
    rows it selects, where the tolerance has an nRMSE limit (None: none, or no row selected). rfc: the
    element-wise numbers under the RFC's
    tolerance, reported beside the verdict. `unusable` says why nothing could be compared (a shape
    mismatch, a NaN reference), None when the numbers stand.
    """

    shape: tuple[int, ...]
    tolerance: Tolerance
    gating: MinTokensRule
    max_abs: float = math.nan
    max_rel: float = math.nan
    n_outside: int = 0
    share_outside: float = math.nan
    margin: float = math.nan
    nrmse: float = math.nan
    nonfinite: int = 0
    worst: dict[str, Any] = dataclasses.field(default_factory=dict)
    rfc: dict[str, Any] = dataclasses.field(default_factory=dict)
    gated_nrmse: float | None = None
    unusable: str | None = None

    @property
    def usable(self) -> bool:
        return self.unusable is None

    @property
    def nrmse_gated(self) -> bool:
        """Whether the nRMSE limit applies: the tolerance has one, and the minimum-tokens rule lets it."""
        return self.tolerance.max_nrmse is not None and self.gating.applies

    @property
    def out_of_tolerance(self) -> bool:
        """The two sides are out of the check's element-wise tolerance of each other (NaN included)."""
        return self.n_outside > 0

    @property
    def criteria(self) -> tuple[Criterion, ...]:
        """No NaN or Inf in the result (`finite`, whichever gate decides), and the absolute gate: every
        element within the tolerance (margin <= 1) and, where the tolerance has one, the nRMSE within
        `max_nrmse` under the minimum-tokens rule; none for a measurement that is not usable."""
        if not self.usable:
            return ()
        tol = self.tolerance
        finite = Criterion(
            "finite", "NaN/Inf values in the result", self.nonfinite, 0.0,
            detail=f"{self.nonfinite} NaN/Inf value(s) in the result",
        )  # fmt: skip
        where = ", ".join(f"{name} {i}" for name, i in self.worst.get("index", {}).items())
        got, expected = self.worst.get("actual", math.nan), self.worst.get("expected", math.nan)
        outside = (
            f"{self.n_outside} of {int(np.prod(self.shape))} elements ({percent(self.share_outside)}) "
            f"outside {tol.atol:g} + {tol.rtol:g}*|ref|; worst at {where}: got {got:.6g}, "
            f"expected {expected:.6g} (margin {self.margin:.3g})"
        )
        criteria = [finite, Criterion("absolute", "margin", self.margin, 1.0, detail=outside)]
        if tol.max_nrmse is not None:
            nrmse = self.nrmse if self.gated_nrmse is None else self.gated_nrmse
            over = "" if nrmse == self.nrmse else f" over the sequences of >= {self.gating.min_tokens} tokens"
            criteria.append(
                Criterion(
                    "absolute", "normalised RMSE", nrmse, tol.max_nrmse, **self.gating.criterion_fields(),
                    detail=f"normalised RMSE {nrmse:.3g} > {tol.max_nrmse:g}{over}",
                )
            )  # fmt: skip
        return tuple(criteria)


def percent(share: float) -> str:
    """A share as a percentage with two significant digits: 1/32768 → `0.0031%`."""
    digits = np.format_float_positional(100 * share, precision=2, unique=False, fractional=False, trim="-")
    return f"{digits}%"


def normalised_rmse(error: np.ndarray, reference: np.ndarray) -> float:
    """`‖error‖₂ / ‖reference‖₂` (0 where both are 0, inf where only the reference is)."""
    ref_norm = float(np.sqrt(np.sum(reference * reference)))
    err_norm = float(np.sqrt(np.sum(error * error)))
    return err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))


def elementwise_ratio(
    error: np.ndarray, reference: np.ndarray, tolerance: Tolerance
) -> tuple[np.ndarray, int]:
    """`error / (atol + rtol·|reference|)` element by element, and how many exceed 1."""
    ratio = error / (tolerance.atol + tolerance.rtol * np.abs(reference))
    return ratio, int(np.count_nonzero(ratio > 1.0))


def elements_outside(actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance) -> int:
    """How many elements of `actual` are out of `tolerance` of `expected` (NaN and Inf always are)."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return elementwise_ratio(np.where(np.isfinite(a), np.abs(a - b), np.inf), b, tolerance)[1]


def measure(
    actual: np.ndarray,
    expected: np.ndarray,
    tolerance: Tolerance,
    rfc_tolerance: Tolerance,
    axes: tuple[str, ...] = (),
    positions: dict[str, np.ndarray] | None = None,
    seq_lens: Sequence[int] | None = None,
    min_tokens: int = 0,
) -> Measurement:
    """`actual` against the reference `expected`.

    `axes` names the dimensions for the worst element's position; `positions` maps an axis to the
    original index of each of its entries, for results that are a selection of rows; `seq_lens` the
    tokens of each sequence, for a result over sequences (axis `seq`: states); `min_tokens` the
    policy's minimum-tokens rule (`min_tokens_rule`), which decides what the nRMSE limit applies to.
    """
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        return _unusable(b.shape, tolerance, f"result has shape {a.shape}, the reference {b.shape}")
    if not np.all(np.isfinite(b)):
        return _unusable(
            b.shape, tolerance, f"the reference holds {int(np.sum(~np.isfinite(b)))} NaN/Inf values"
        )
    if a.size == 0:
        return _unusable(b.shape, tolerance, "nothing to compare (empty result)")
    finite = np.isfinite(a)
    error = np.where(finite, np.abs(a - b), np.inf)
    ratio, n_outside = elementwise_ratio(error, b, tolerance)
    rfc_ratio, rfc_outside = elementwise_ratio(error, b, rfc_tolerance)
    flat_worst = int(np.argmax(ratio))
    index = np.unravel_index(flat_worst, a.shape)
    names = axes if len(axes) == a.ndim else tuple(f"dim{i}" for i in range(a.ndim))
    positions = positions or {}
    nonzero = b != 0
    gating = min_tokens_rule(names, a.shape[0], seq_lens, min_tokens)
    gated = tolerance.max_nrmse is not None and gating.rows.any()
    return Measurement(
        shape=a.shape,
        max_abs=float(error.max()),
        max_rel=float((error[nonzero] / np.abs(b[nonzero])).max()) if nonzero.any() else 0.0,
        n_outside=n_outside,
        share_outside=n_outside / a.size,
        margin=float(ratio.max()),
        nrmse=normalised_rmse(error, b),
        nonfinite=int(a.size - np.count_nonzero(finite)),
        worst={
            "index": {
                name: int(positions[name][i]) if name in positions else int(i)
                for name, i in zip(names, index)
            },
            "actual": float(a.flat[flat_worst]),
            "expected": float(b.flat[flat_worst]),
        },
        tolerance=tolerance,
        gating=gating,
        gated_nrmse=normalised_rmse(error[gating.rows], b[gating.rows]) if gated else None,
        rfc={
            **rfc_tolerance.as_dict(),
            "n_outside": rfc_outside,
            "share_outside": rfc_outside / a.size,
            "margin": float(rfc_ratio.max()),
            "passed": rfc_outside == 0,
        },
    )


def _unusable(shape: tuple[int, ...], tolerance: Tolerance, reason: str) -> Measurement:
    gating = MinTokensRule(np.zeros(shape[:1] or (0,), bool), 0, 0)
    return Measurement(tuple(shape), tolerance, gating, unusable=reason)
