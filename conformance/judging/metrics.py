"""How close a result is to its reference: the numbers every check records, and its verdict.

Where the float64 truth is known, both sides' own errors against it are recorded too (`Attribution`):
who the difference between them comes from, and the relative gate (docs/tolerance-policy.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance.judging.tolerances import CONTRACT_MODE, ContractLimits, RelativeLimits, Tolerance
from conformance.judging.verdict import Criterion, Verdict, decide

# Who a check's difference comes from, judged against the float64 truth (docs/tolerance-policy.md).
VERDICTS = ("impl", "reference", "both", "conditioning")


@dataclasses.dataclass(frozen=True)
class TruthError:
    """One side's error against the float64 truth, as a check records errors: `margin` the worst
    `|x - t| / (atol + rtol·|t|)` under the check's tolerance, `nrmse` `‖x - t‖₂ / ‖t‖₂`, `max_abs`."""

    margin: float
    nrmse: float
    max_abs: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def error_vs_truth(x: np.ndarray, truth: np.ndarray, tolerance: Tolerance) -> TruthError:
    """The error of `x` against `truth` (same shape); a NaN/Inf in `x` is an infinite error."""
    x, t = np.asarray(x, np.float64), np.asarray(truth, np.float64)
    if x.shape != t.shape:
        raise ValueError(f"result of shape {x.shape} against a truth of shape {t.shape}")
    error = np.where(np.isfinite(x), np.abs(x - t), np.inf)
    ratio, _ = _elementwise(error, t, tolerance)
    return TruthError(margin=float(ratio.max()), nrmse=_nrmse(error, t), max_abs=float(error.max()))


def relative_criteria(side: TruthError, other: TruthError, limits: RelativeLimits) -> tuple[Criterion, ...]:
    """The relative gate on `side`: its error against the truth within `factor` × `other`'s plus a floor,
    in margin and in nRMSE."""
    f = limits.factor
    return (
        Criterion("relative", "margin vs truth", side.margin, limits.margin_floor, f, other.margin),
        Criterion("relative", "nRMSE vs truth", side.nrmse, limits.nrmse_floor, f, other.nrmse),
    )


def excess(side: TruthError, other: TruthError, limits: RelativeLimits) -> list[str]:
    """Why `side` is further from the truth than `limits` allow against `other`; empty when it is not."""
    return [c.text() for c in relative_criteria(side, other, limits) if not c.holds]


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The implementation's and the reference's own errors against the float64 truth of a check."""

    source: str  # where the truth comes from: a dump key, or the float64 recurrence
    impl: TruthError
    reference: TruthError
    limits: RelativeLimits
    apart: bool  # the two sides are out of the check's element-wise tolerance of each other

    @property
    def relative_criteria(self) -> tuple[Criterion, ...]:
        """The relative gate: the implementation no further from the truth than the reference allows."""
        return relative_criteria(self.impl, self.reference, self.limits)

    @property
    def relative_failures(self) -> list[str]:
        """Why the implementation is further from the truth than the relative gate allows."""
        return [c.text() for c in self.relative_criteria if not c.holds]

    @property
    def relative_ratio(self) -> float:
        """The implementation's error as a share of what the relative gate allows (<= 1 holds)."""
        return Verdict("relative", self.relative_criteria).ratio

    @property
    def verdict(self) -> str:
        """`impl` / `reference`: that side is clearly further from the truth than the other (beyond the
        relative gate's factor and floor, either way round); `both`: each is, on a different measure,
        or neither is while the two sides are out of tolerance of each other and each is out of the
        check's tolerance of the truth; `conditioning`: neither is, and at least one side is within
        the check's tolerance of the truth (or the sides agree): equally good results, whose
        difference is what the computation's conditioning makes of their roundings."""
        impl_worse = bool(self.relative_failures)
        reference_worse = bool(excess(self.reference, self.impl, self.limits))
        if impl_worse and reference_worse:
            return "both"
        if impl_worse or reference_worse:
            return "impl" if impl_worse else "reference"
        both_off = min(self.impl.margin, self.reference.margin) > 1
        return "both" if self.apart and both_off else "conditioning"

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": True,
            "source": self.source,
            "impl": self.impl.as_dict(),
            "reference": self.reference.as_dict(),
            "limits": self.limits.as_dict(),
            "apart": self.apart,
            "verdict": self.verdict,
            "relative_ratio": self.relative_ratio,
            "relative_failures": self.relative_failures,
        }


def attribute(
    actual: np.ndarray,
    expected: np.ndarray,
    truth: np.ndarray,
    source: str,
    tolerance: Tolerance,
    limits: RelativeLimits,
    apart: bool,
) -> Attribution:
    """Both sides of a check against its float64 truth; `apart`: whether the check's absolute
    comparison of the two sides failed."""
    return Attribution(
        source=source,
        impl=error_vs_truth(actual, truth, tolerance),
        reference=error_vs_truth(expected, truth, tolerance),
        limits=limits,
        apart=apart,
    )


@dataclasses.dataclass(frozen=True)
class StatisticRows:
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

    def gating(self) -> dict[str, int]:
        """The criterion fields that carry the rule."""
        return {"tokens": self.tokens, "min_tokens": self.min_tokens}


def statistic_rows(
    axes: tuple[str, ...], rows: int, seq_lens: Sequence[int] | None, min_tokens: int
) -> StatisticRows:
    """The minimum-tokens rule for a result of `rows` entries along its leading axis `axes[0]`: a
    per-token result (`token`) counts its rows, and applies whole; a per-sequence one (`seq`: states)
    counts each sequence's own tokens (`seq_lens`) and applies over the sequences long enough; any other
    result is one whole output the rule lets through."""
    if axes[:1] == ("seq",) and seq_lens is not None:
        if len(seq_lens) != rows:
            raise ValueError(f"{len(seq_lens)} sequence lengths for a result of {rows} sequences")
        lens = np.asarray(seq_lens, np.int64)
        return StatisticRows(lens >= min_tokens, int(lens.max()), min_tokens)
    tokens = rows if axes[:1] == ("token",) else min_tokens
    return StatisticRows(np.full(rows, tokens >= min_tokens), tokens, min_tokens)


@dataclasses.dataclass(frozen=True)
class ContractError:
    """One side against the bf16 precision contract's float64 model `m`: `nrmse` `‖x - m‖₂ / ‖m‖₂`, and
    `gain` `<x - m, m> / <m, m>`, the part of the error along the model: what a scale defect (a weight
    times 1 + ε) adds to it, and what independent roundings average out of it."""

    nrmse: float
    gain: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def error_vs_contract(x: np.ndarray, model: np.ndarray) -> ContractError:
    """The error of `x` against the contract's model (same shape); a NaN/Inf in `x` is an infinite one."""
    x, m = np.asarray(x, np.float64), np.asarray(model, np.float64)
    if x.shape != m.shape:
        raise ValueError(f"result of shape {x.shape} against a contract model of shape {m.shape}")
    if not np.all(np.isfinite(x)):
        return ContractError(nrmse=float("inf"), gain=float("inf"))
    error = x - m
    norm2 = float(np.sum(m * m))
    gain = float(np.sum(error * m)) / norm2 if norm2 > 0 else (0.0 if not error.any() else float("inf"))
    return ContractError(nrmse=_nrmse(np.abs(error), m), gain=gain)


@dataclasses.dataclass(frozen=True)
class ContractCheck:
    """The implementation against the bf16 precision contract (docs/tolerance-policy.md): its nRMSE and
    gain against the float64 model of the contract's roundings, under `limits`, over the rows the
    minimum-tokens rule selects; the reference's own numbers beside it, reported only (a reference may
    round elsewhere: transformers' port does)."""

    source: str
    impl: ContractError
    reference: ContractError
    limits: ContractLimits
    fp32_stage: bool  # the contract keeps this result in fp32 (g, beta, states): the tighter nRMSE limit
    gating: StatisticRows  # the minimum-tokens rule on the result
    impl_truth_nrmse: float  # the implementation's nRMSE against the float64 truth
    model_truth_nrmse: float  # the model's own: what the contract's roundings cost

    @property
    def criteria(self) -> tuple[Criterion, ...]:
        """The contract on the implementation: its nRMSE (the limit of a bf16 or an fp32 stage) and
        |gain| against the model, under the minimum-tokens rule, unless it is `closer_factor` times
        closer to the truth than the model itself (it rounds less, not worse)."""
        limits = self.limits
        closer = Criterion(
            "contract",
            f"{limits.closer_factor:g}× closer to the float64 truth than the contract's model",
            self.impl_truth_nrmse * limits.closer_factor,
            0.0,
            1.0,
            self.model_truth_nrmse,
        )
        gating = {**self.gating.gating(), "unless": closer}
        gain = abs(self.impl.gain)
        return (
            Criterion("contract", "nRMSE vs the contract's model", self.impl.nrmse, self.max_nrmse, **gating),
            Criterion(
                "contract", "|gain| vs the contract's model", gain, limits.max_gain, **gating,
                detail=f"gain vs the contract's model {self.impl.gain:+.3g}, |gain| > {limits.max_gain:g}",
            ),
        )  # fmt: skip

    @property
    def closer(self) -> bool:
        """The implementation is `closer_factor` times closer to the truth than the model: exempt."""
        return self.criteria[0].unless.holds

    @property
    def max_nrmse(self) -> float:
        return self.limits.max_nrmse_of(self.fp32_stage)

    @property
    def gated(self) -> bool:
        """The minimum-tokens rule lets the contract decide."""
        return self.gating.applies

    @property
    def failures(self) -> list[str]:
        return [c.text() for c in self.criteria if not c.holds]

    @property
    def ratio(self) -> float:
        """The larger criterion as a share of its limit (<= 1 holds); 0 where it is not gated or exempt."""
        return Verdict("relative+contract", self.criteria).ratio

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": True,
            "source": self.source,
            "impl": self.impl.as_dict(),
            "reference": self.reference.as_dict(),
            "limits": self.limits.as_dict(),
            "fp32_stage": self.fp32_stage,
            **self.gating.gating(),
            "gated": self.gating.applies,
            "truth_nrmse": {"impl": self.impl_truth_nrmse, "model": self.model_truth_nrmse},
            "closer": self.closer,
            "max_nrmse": self.max_nrmse,
            "ratio": self.ratio,
            "failures": self.failures,
        }


def contract_check(
    actual: np.ndarray,
    expected: np.ndarray,
    model: np.ndarray,
    truth: np.ndarray,
    impl_truth_nrmse: float,
    source: str,
    limits: ContractLimits,
    fp32_stage: bool,
    gating: StatisticRows,
) -> ContractCheck:
    """Both sides of a check against the contract's float64 `model` (where it comes from: `source`), over
    the rows `gating` selects (all of them where it selects none: reported, not gated); the model against
    the float64 `truth`, beside the implementation's nRMSE against it (`TruthError.nrmse` of the check's
    attribution)."""
    rows = gating.rows if gating.rows.any() else slice(None)
    return ContractCheck(
        source=source,
        impl=error_vs_contract(np.asarray(actual)[rows], np.asarray(model)[rows]),
        reference=error_vs_contract(np.asarray(expected)[rows], np.asarray(model)[rows]),
        limits=limits,
        fp32_stage=fp32_stage,
        gating=gating,
        impl_truth_nrmse=impl_truth_nrmse,
        model_truth_nrmse=error_vs_contract(model, truth).nrmse,
    )


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One result against its reference under one tolerance: the numbers, before any verdict.

    margin: worst `|a - b| / (atol + rtol * |b|)` (<= 1 is within the tolerance element-wise);
    nrmse: fla's normalised RMSE `‖a - b‖₂ / ‖b‖₂`; worst: the element that sets the margin.
    gating: the minimum-tokens rule on the result (`statistic_rows`); gated_nrmse: the nRMSE over the
    rows it selects, where the tolerance has an nRMSE limit (None: none, or no row selected). rfc: the
    element-wise numbers under the RFC's
    tolerance, reported beside the verdict. `unusable` says why nothing could be compared (a shape
    mismatch, a NaN reference), None when the numbers stand.
    """

    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    n_outside: int
    share_outside: float
    margin: float
    nrmse: float
    nonfinite: int
    worst: dict[str, Any]
    tolerance: Tolerance
    rfc: dict[str, Any]
    gating: StatisticRows
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
    def apart(self) -> bool:
        """The two sides are out of the check's element-wise tolerance of each other (NaN included)."""
        return self.n_outside > 0

    @property
    def finite_criterion(self) -> Criterion:
        """No NaN or Inf in the result, whichever gate decides."""
        detail = f"{self.nonfinite} NaN/Inf value(s) in the result"
        return Criterion("finite", "NaN/Inf values in the result", self.nonfinite, 0.0, detail=detail)

    @property
    def absolute_criteria(self) -> tuple[Criterion, ...]:
        """The absolute gate: every element within the tolerance (margin <= 1) and, where the tolerance
        has one, the nRMSE within `max_nrmse` under the minimum-tokens rule."""
        tol = self.tolerance
        where = ", ".join(f"{name} {i}" for name, i in self.worst.get("index", {}).items())
        got, expected = self.worst.get("actual", math.nan), self.worst.get("expected", math.nan)
        outside = (
            f"{self.n_outside} of {int(np.prod(self.shape))} elements ({percent(self.share_outside)}) "
            f"outside {tol.atol:g} + {tol.rtol:g}*|ref|; worst at {where}: got {got:.6g}, "
            f"expected {expected:.6g} (margin {self.margin:.3g})"
        )
        criteria = [Criterion("absolute", "margin", self.margin, 1.0, detail=outside)]
        if tol.max_nrmse is not None:
            nrmse = self.nrmse if self.gated_nrmse is None else self.gated_nrmse
            over = "" if nrmse == self.nrmse else f" over the sequences of >= {self.gating.min_tokens} tokens"
            criteria.append(
                Criterion(
                    "absolute", "normalised RMSE", nrmse, tol.max_nrmse, **self.gating.gating(),
                    detail=f"normalised RMSE {nrmse:.3g} > {tol.max_nrmse:g}{over}",
                )
            )  # fmt: skip
        return tuple(criteria)


@dataclasses.dataclass(frozen=True)
class Comparison(Measurement):
    """A measurement decided: its criteria, by the gate `mode` of the check's policy (`decision`).

    attribution: both sides against the float64 truth, or None with `no_truth` saying why; contract: the
    implementation against the bf16 precision contract's model where the mode asks for it, or None with
    `no_contract` saying why. Without a truth the absolute gate decides; without a model of the contract,
    the relative gate alone (`verdict.judged_by`).
    """

    mode: str = "absolute"
    attribution: Attribution | None = None
    no_truth: str | None = "not looked up"
    contract: ContractCheck | None = None
    no_contract: str | None = "not looked up"
    decision: Verdict = dataclasses.field(default_factory=lambda: Verdict("absolute", ()))

    @property
    def passed(self) -> bool:
        return self.usable and self.decision.passed

    @property
    def failures(self) -> list[str]:
        """What decides against the check."""
        return [self.unusable] if not self.usable else self.decision.failures()

    @property
    def absolute_failures(self) -> list[str]:
        """What the absolute limits say, whether they decide or not."""
        if not self.usable:
            return [self.unusable]
        return self.decision.failures("finite") + self.decision.failures("absolute")

    @property
    def judged_by(self) -> str:
        return self.decision.judged_by

    @property
    def absolute_ratio(self) -> float:
        """The largest of the absolute gate's criteria as a share of its limit: <= 1 holds."""
        return Verdict("absolute", self.absolute_criteria).ratio if self.usable else math.nan

    @property
    def gate_ratio(self) -> float:
        """The largest criterion of the deciding gate(s) as a share of its limit: <= 1 holds."""
        return self.decision.ratio if self.usable else math.nan

    @property
    def verdict(self) -> str:
        """Who the difference comes from (`VERDICTS`), or `n/a` without a truth."""
        return "n/a" if self.attribution is None else self.attribution.verdict

    def summary(self) -> str:
        """One line: what failed (or the margin when it holds), where, and by how much."""
        if self.passed:
            note = " (not gated: too few tokens)" if self.tolerance.max_nrmse and not self.nrmse_gated else ""
            text = f"holds: margin {self.margin:.3g}, nrmse {self.nrmse:.3g}{note}"
            if self.judged_by != "absolute":
                text += f"; {self.judged_by} gate ratio {self.gate_ratio:.3g}"
        else:
            text = "; ".join(self.failures)
        if self.attribution is not None:
            a = self.attribution
            text += (
                f" [vs truth: impl margin {a.impl.margin:.3g}, reference {a.reference.margin:.3g}; "
                f"verdict {a.verdict}]"
            )
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "n_outside": self.n_outside,
            "share_outside": self.share_outside,
            "margin": self.margin,
            "nrmse": self.nrmse,
            "nrmse_gated": self.nrmse_gated,
            "gated_nrmse": self.gated_nrmse,
            "gate_ratio": self.gate_ratio,
            "nonfinite": self.nonfinite,
            "worst": self.worst,
            "tolerance": self.tolerance.as_dict(),
            "rfc": self.rfc,
            "passed": self.passed,
            "failures": self.failures,
            "mode": self.mode,
            "judged_by": self.judged_by,
            "criteria": [criterion.as_dict() for criterion in self.decision.criteria],
            "absolute_ratio": self.absolute_ratio,
            "absolute_failures": self.absolute_failures,
            "truth": (
                self.attribution.as_dict()
                if self.attribution is not None
                else {"available": False, "reason": self.no_truth}
            ),
            "contract": (
                self.contract.as_dict()
                if self.contract is not None
                else {"available": False, "reason": self.no_contract}
            ),
        }


def percent(share: float) -> str:
    """A share as a percentage with two significant digits: 1/32768 → `0.0031%`."""
    digits = np.format_float_positional(100 * share, precision=2, unique=False, fractional=False, trim="-")
    return f"{digits}%"


def _nrmse(error: np.ndarray, reference: np.ndarray) -> float:
    ref_norm = float(np.sqrt(np.sum(reference * reference)))
    err_norm = float(np.sqrt(np.sum(error * error)))
    return err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))


def _elementwise(error: np.ndarray, reference: np.ndarray, tolerance: Tolerance) -> tuple[np.ndarray, int]:
    ratio = error / (tolerance.atol + tolerance.rtol * np.abs(reference))
    return ratio, int(np.count_nonzero(ratio > 1.0))


def elements_outside(actual: np.ndarray, expected: np.ndarray, tolerance: Tolerance) -> int:
    """How many elements of `actual` are out of `tolerance` of `expected` (NaN and Inf always are)."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return _elementwise(np.where(np.isfinite(a), np.abs(a - b), np.inf), b, tolerance)[1]


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
    policy's minimum-tokens rule (`statistic_rows`), which decides what the nRMSE limit applies to.
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
    ratio, n_outside = _elementwise(error, b, tolerance)
    rfc_ratio, rfc_outside = _elementwise(error, b, rfc_tolerance)
    flat_worst = int(np.argmax(ratio))
    index = np.unravel_index(flat_worst, a.shape)
    names = axes if len(axes) == a.ndim else tuple(f"dim{i}" for i in range(a.ndim))
    positions = positions or {}
    nonzero = b != 0
    gating = statistic_rows(names, a.shape[0], seq_lens, min_tokens)
    gated = tolerance.max_nrmse is not None and gating.rows.any()
    return Measurement(
        shape=a.shape,
        max_abs=float(error.max()),
        max_rel=float((error[nonzero] / np.abs(b[nonzero])).max()) if nonzero.any() else 0.0,
        n_outside=n_outside,
        share_outside=n_outside / a.size,
        margin=float(ratio.max()),
        nrmse=_nrmse(error, b),
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
        gated_nrmse=_nrmse(error[gating.rows], b[gating.rows]) if gated else None,
        rfc={
            **rfc_tolerance.as_dict(),
            "n_outside": rfc_outside,
            "share_outside": rfc_outside / a.size,
            "margin": float(rfc_ratio.max()),
            "passed": rfc_outside == 0,
        },
    )


def judge(
    measured: Measurement,
    mode: str,
    attribution: Attribution | None,
    no_truth: str | None = None,
    contract: ContractCheck | None = None,
    no_contract: str | None = None,
    relative: tuple[Criterion, ...] | None = None,
) -> Comparison:
    """`measured` decided by the gate `mode` (`verdict.MODE_GATES`): its absolute criteria, the
    relative gate's where there is a truth (`attribution`, or None with `no_truth` saying why; `relative`
    in place of the attribution's own criteria) and the precision contract's where there is its model
    (`contract`, or None with `no_contract` saying why)."""
    if contract is None and no_contract is None:
        no_contract = "not looked up" if mode == CONTRACT_MODE else f"gate mode {mode!r} has no contract"
    criteria: tuple[Criterion, ...] = ()
    if measured.usable:
        criteria = (measured.finite_criterion, *measured.absolute_criteria)
        if attribution is not None:
            criteria += attribution.relative_criteria if relative is None else relative
        if contract is not None:
            criteria += contract.criteria
    fields = {field.name: getattr(measured, field.name) for field in dataclasses.fields(Measurement)}
    return Comparison(
        **fields,
        mode=mode,
        attribution=attribution,
        no_truth=no_truth,
        contract=contract,
        no_contract=no_contract,
        decision=decide(mode, criteria),
    )


def compare(
    actual: np.ndarray,
    expected: np.ndarray,
    tolerance: Tolerance,
    rfc_tolerance: Tolerance,
    axes: tuple[str, ...] = (),
    positions: dict[str, np.ndarray] | None = None,
    seq_lens: Sequence[int] | None = None,
    min_tokens: int = 0,
) -> Comparison:
    """`measure` decided by the absolute gate alone (no truth looked up)."""
    measured = measure(actual, expected, tolerance, rfc_tolerance, axes, positions, seq_lens, min_tokens)
    return judge(measured, "absolute", None, "not looked up")


def _unusable(shape: tuple[int, ...], tolerance: Tolerance, reason: str) -> Measurement:
    nan = float("nan")
    return Measurement(
        shape=tuple(shape),
        max_abs=nan,
        max_rel=nan,
        n_outside=0,
        share_outside=nan,
        margin=nan,
        nrmse=nan,
        nonfinite=0,
        worst={},
        tolerance=tolerance,
        rfc={},
        gating=StatisticRows(np.zeros(shape[:1] or (0,), bool), 0, 0),
        unusable=reason,
    )
