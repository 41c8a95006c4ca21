"""How close a result is to its reference: the numbers every check records, and its verdict.

Where the float64 truth is known, both sides' own errors against it are recorded too (`Attribution`):
who the difference between them comes from, and the relative gate (docs/tolerance-policy.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance.tolerances import ABSOLUTE_MODES, CONTRACT_MODE, ContractLimits, RelativeLimits, Tolerance

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


def excess(side: TruthError, other: TruthError, limits: RelativeLimits) -> list[str]:
    """Why `side` is further from the truth than `limits` allow against `other`; empty when it is not."""
    reasons = []
    f = limits.factor
    if not side.margin <= f * other.margin + limits.margin_floor:
        reasons.append(
            f"margin vs truth {side.margin:.3g} > {f:g}×{other.margin:.3g} + {limits.margin_floor:g}"
        )
    if not side.nrmse <= f * other.nrmse + limits.nrmse_floor:
        reasons.append(f"nRMSE vs truth {side.nrmse:.3g} > {f:g}×{other.nrmse:.3g} + {limits.nrmse_floor:g}")
    return reasons


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The implementation's and the reference's own errors against the float64 truth of a check."""

    source: str  # where the truth comes from: a dump key, or the float64 recurrence
    impl: TruthError
    reference: TruthError
    limits: RelativeLimits
    apart: bool  # the two sides are out of the check's absolute tolerance of each other

    @property
    def relative_failures(self) -> list[str]:
        """The relative gate: why the implementation is further from the truth than allowed."""
        return excess(self.impl, self.reference, self.limits)

    @property
    def relative_ratio(self) -> float:
        """The implementation's error as a share of what the relative gate allows (<= 1 holds)."""
        f = self.limits.factor
        return max(
            self.impl.margin / (f * self.reference.margin + self.limits.margin_floor),
            self.impl.nrmse / (f * self.reference.nrmse + self.limits.nrmse_floor),
        )

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
    gain against the float64 model of the contract's roundings, under `limits`; the reference's own
    numbers beside it, reported only (a reference may round elsewhere: transformers' port does)."""

    source: str
    impl: ContractError
    reference: ContractError
    limits: ContractLimits
    fp32_stage: bool  # the contract keeps this result in fp32 (g, beta, states): the tighter nRMSE limit
    tokens: int  # the tokens the result comes from: it is gated from `limits.min_tokens` on
    impl_truth_nrmse: float  # the implementation's nRMSE against the float64 truth
    model_truth_nrmse: float  # the model's own: what the contract's roundings cost

    @property
    def closer(self) -> bool:
        """The implementation is `closer_factor` times closer to the truth than the model: exempt."""
        return self.impl_truth_nrmse * self.limits.closer_factor <= self.model_truth_nrmse

    @property
    def max_nrmse(self) -> float:
        return self.limits.max_nrmse_of(self.fp32_stage)

    @property
    def gated(self) -> bool:
        return self.limits.gates(self.tokens)

    @property
    def failures(self) -> list[str]:
        reasons = []
        if not self.gated or self.closer:
            return reasons
        if not self.impl.nrmse <= self.max_nrmse:
            reasons.append(f"nRMSE vs the contract's model {self.impl.nrmse:.3g} > {self.max_nrmse:g}")
        if not abs(self.impl.gain) <= self.limits.max_gain:
            reasons.append(
                f"gain vs the contract's model {self.impl.gain:+.3g}, |gain| > {self.limits.max_gain:g}"
            )
        return reasons

    @property
    def ratio(self) -> float:
        """The larger criterion as a share of its limit (<= 1 holds); 0 where it is not gated or exempt."""
        if not self.gated or self.closer:
            return 0.0
        return max(self.impl.nrmse / self.max_nrmse, abs(self.impl.gain) / self.limits.max_gain)

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": True,
            "source": self.source,
            "impl": self.impl.as_dict(),
            "reference": self.reference.as_dict(),
            "limits": self.limits.as_dict(),
            "fp32_stage": self.fp32_stage,
            "tokens": self.tokens,
            "gated": self.gated,
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
    tokens: int,
) -> ContractCheck:
    """Both sides of a check against the contract's float64 `model` (where it comes from: `source`) of a
    result that `tokens` tokens produced; the model against the float64 `truth`, beside the
    implementation's nRMSE against it (`TruthError.nrmse` of the check's attribution)."""
    return ContractCheck(
        source=source,
        impl=error_vs_contract(actual, model),
        reference=error_vs_contract(expected, model),
        limits=limits,
        fp32_stage=fp32_stage,
        tokens=tokens,
        impl_truth_nrmse=impl_truth_nrmse,
        model_truth_nrmse=error_vs_contract(model, truth).nrmse,
    )


@dataclasses.dataclass
class Comparison:
    """One result against its reference under one tolerance.

    margin: worst `|a - b| / (atol + rtol * |b|)` (a check holds element-wise when it is <= 1);
    nrmse: fla's normalised RMSE `‖a - b‖₂ / ‖b‖₂`; worst: the element that sets the margin.
    nrmse_gated: whether the nRMSE limit applies (`Tolerance.gates_nrmse`); gated_nrmse: the nRMSE over
    the part it applies to (a state's sequences of enough tokens; else the whole result).
    rfc: the same element-wise numbers under the RFC's tolerance, reported beside the verdict.
    mode: the gate mode of the check's policy; attribution: both sides against the float64 truth, or
    None with `no_truth` saying why; contract: the implementation against the bf16 precision contract's
    model where the mode asks for it, or None with `no_contract` saying why. `failures` are what decide
    the check (`judged_by`: the relative gate needs a truth, so without one the absolute gate decides;
    the contract needs its model, so without one the relative gate decides alone); `absolute_failures`
    what the absolute limits say, whether they decide or not.
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
    nrmse_gated: bool
    rfc: dict[str, Any]
    failures: list[str]
    gated_nrmse: float | None = None
    absolute_failures: list[str] = dataclasses.field(default_factory=list)
    mode: str = "absolute"
    attribution: Attribution | None = None
    no_truth: str | None = "not looked up"
    contract: ContractCheck | None = None
    no_contract: str | None = "not looked up"
    usable: bool = True  # False when nothing could be compared (shape mismatch, NaN reference)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def judged_by(self) -> str:
        """The gate(s) that decide: the policy's mode, "absolute" where there is no truth, "relative"
        where the mode asks for the contract and there is no model of it."""
        if self.attribution is None:
            return "absolute"
        if self.mode == CONTRACT_MODE and self.contract is None:
            return "relative"
        return self.mode

    @property
    def absolute_ratio(self) -> float:
        """The largest of the absolute gate's criteria as a share of its limit: <= 1 holds."""
        if self.nrmse_gated:
            return max(self.margin, self.gated_nrmse / self.tolerance.max_nrmse)
        return self.margin

    @property
    def gate_ratio(self) -> float:
        """The largest criterion of the deciding gate(s) as a share of its limit: <= 1 holds."""
        if self.judged_by == "absolute":
            return self.absolute_ratio
        if self.judged_by == "relative":
            return self.attribution.relative_ratio
        if self.judged_by == CONTRACT_MODE:
            return max(self.attribution.relative_ratio, self.contract.ratio)
        return max(self.absolute_ratio, self.attribution.relative_ratio)

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


def _nrmse_rows(
    tolerance: Tolerance, axes: tuple[str, ...], rows: int, seq_lens: Sequence[int] | None
) -> np.ndarray:
    """Which rows of the leading axis the nRMSE limit applies to (`Tolerance.gates_nrmse`): a per-token
    result by its number of rows, a per-sequence one (states) by the tokens of each sequence."""
    if axes[:1] == ("seq",) and seq_lens is not None:
        if len(seq_lens) != rows:
            raise ValueError(f"{len(seq_lens)} sequence lengths for a result of {rows} sequences")
        return np.array([tolerance.gates_nrmse(int(n)) for n in seq_lens], bool)
    if axes[:1] == ("token",):
        return np.full(rows, tolerance.gates_nrmse(rows))
    return np.full(rows, tolerance.max_nrmse is not None)


def _elementwise(error: np.ndarray, reference: np.ndarray, tolerance: Tolerance) -> tuple[np.ndarray, int]:
    ratio = error / (tolerance.atol + tolerance.rtol * np.abs(reference))
    return ratio, int(np.count_nonzero(ratio > 1.0))


def compare(
    actual: np.ndarray,
    expected: np.ndarray,
    tolerance: Tolerance,
    rfc_tolerance: Tolerance,
    axes: tuple[str, ...] = (),
    positions: dict[str, np.ndarray] | None = None,
    seq_lens: Sequence[int] | None = None,
) -> Comparison:
    """Compare `actual` with the reference `expected`.

    `axes` names the dimensions for the worst element's position; `positions` maps an axis to the
    original index of each of its entries, for results that are a selection of rows; `seq_lens` the
    tokens of each sequence, for a result over sequences (axis `seq`: states), whose nRMSE limit then
    applies to the states of the sequences long enough (`Tolerance.gates_nrmse`).
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
    nonfinite = int(a.size - np.count_nonzero(finite))
    error = np.where(finite, np.abs(a - b), np.inf)
    ratio, n_outside = _elementwise(error, b, tolerance)
    rfc_ratio, rfc_outside = _elementwise(error, b, rfc_tolerance)
    flat_worst = int(np.argmax(ratio))
    index = np.unravel_index(flat_worst, a.shape)
    names = axes if len(axes) == a.ndim else tuple(f"dim{i}" for i in range(a.ndim))
    positions = positions or {}
    nonzero = b != 0
    gated_rows = _nrmse_rows(tolerance, names, a.shape[0], seq_lens)
    comparison = Comparison(
        shape=a.shape,
        max_abs=float(error.max()),
        max_rel=float((error[nonzero] / np.abs(b[nonzero])).max()) if nonzero.any() else 0.0,
        n_outside=n_outside,
        share_outside=n_outside / a.size,
        margin=float(ratio.max()),
        nrmse=_nrmse(error, b),
        nonfinite=nonfinite,
        worst={
            "index": {
                name: int(positions[name][i]) if name in positions else int(i)
                for name, i in zip(names, index)
            },
            "actual": float(a.flat[flat_worst]),
            "expected": float(b.flat[flat_worst]),
        },
        tolerance=tolerance,
        nrmse_gated=bool(gated_rows.any()),
        gated_nrmse=_nrmse(error[gated_rows], b[gated_rows]) if gated_rows.any() else None,
        rfc={
            **rfc_tolerance.as_dict(),
            "n_outside": rfc_outside,
            "share_outside": rfc_outside / a.size,
            "margin": float(rfc_ratio.max()),
            "passed": rfc_outside == 0,
        },
        failures=[],
    )
    comparison.absolute_failures = comparison.failures = _failures(comparison)
    return comparison


def judge(
    comparison: Comparison,
    mode: str,
    attribution: Attribution | None,
    no_truth: str | None = None,
    contract: ContractCheck | None = None,
    no_contract: str | None = None,
) -> Comparison:
    """Decide `comparison` by the gate `mode` (`tolerances.GATE_MODES`), given its truth attribution
    (None, with `no_truth` saying why, when there is no truth: then the absolute gate decides) and, for
    the contract mode, its precision-contract check (None, with `no_contract` saying why, when there is
    no model of the contract: then the relative gate decides alone)."""
    comparison.mode, comparison.attribution, comparison.no_truth = mode, attribution, no_truth
    if contract is None and no_contract is None:
        no_contract = "not looked up" if mode == CONTRACT_MODE else f"gate mode {mode!r} has no contract"
    comparison.contract, comparison.no_contract = contract, no_contract
    if not comparison.usable:
        return comparison
    failures = []
    if comparison.judged_by in ABSOLUTE_MODES:
        failures += comparison.absolute_failures
    elif comparison.nonfinite:
        failures.append(f"{comparison.nonfinite} NaN/Inf value(s) in the result")
    if comparison.judged_by != "absolute":
        failures += [f"relative to the reference: {reason}" for reason in attribution.relative_failures]
    if comparison.judged_by == CONTRACT_MODE:
        failures += [f"precision contract: {reason}" for reason in contract.failures]
    comparison.failures = failures
    return comparison


def _failures(c: Comparison) -> list[str]:
    tol = c.tolerance
    failures = []
    if c.nonfinite:
        failures.append(f"{c.nonfinite} NaN/Inf value(s) in the result")
    if c.n_outside:
        where = ", ".join(f"{name} {i}" for name, i in c.worst["index"].items())
        failures.append(
            f"{c.n_outside} of {int(np.prod(c.shape))} elements ({percent(c.share_outside)}) outside "
            f"{tol.atol:g} + {tol.rtol:g}*|ref|; worst at {where}: got {c.worst['actual']:.6g}, "
            f"expected {c.worst['expected']:.6g} (margin {c.margin:.3g})"
        )
    if c.nrmse_gated and not c.gated_nrmse <= tol.max_nrmse:
        over = "" if c.gated_nrmse == c.nrmse else f" over the sequences of >= {tol.nrmse_min_tokens} tokens"
        failures.append(f"normalised RMSE {c.gated_nrmse:.3g} > {tol.max_nrmse:g}{over}")
    return failures


def _unusable(shape: tuple[int, ...], tolerance: Tolerance, reason: str) -> Comparison:
    nan = float("nan")
    return Comparison(
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
        nrmse_gated=False,
        rfc={},
        failures=[reason],
        absolute_failures=[reason],
        usable=False,
    )
