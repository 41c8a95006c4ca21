"""How close a result is to its reference: the numbers every check records, and its verdict."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from conformance.tolerances import Tolerance


@dataclasses.dataclass
class Comparison:
    """One result against its reference under one tolerance.

    margin: worst `|a - b| / (atol + rtol * |b|)` (a check holds element-wise when it is <= 1);
    nrmse: fla's normalised RMSE `‖a - b‖₂ / ‖b‖₂`; worst: the element that sets the margin.
    rfc: the same element-wise numbers under the RFC's tolerance, reported beside the verdict.
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

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def gate_ratio(self) -> float:
        """The largest of the gate's criteria as a share of its limit: <= 1 holds."""
        if self.nrmse_gated:
            return max(self.margin, self.nrmse / self.tolerance.max_nrmse)
        return self.margin

    def summary(self) -> str:
        """One line: what failed (or the margin when it holds), where, and by how much."""
        if self.passed:
            note = " (not gated: too few tokens)" if self.tolerance.max_nrmse and not self.nrmse_gated else ""
            return f"holds: margin {self.margin:.3g}, nrmse {self.nrmse:.3g}{note}"
        return "; ".join(self.failures)

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
            "gate_ratio": self.gate_ratio,
            "nonfinite": self.nonfinite,
            "worst": self.worst,
            "tolerance": self.tolerance.as_dict(),
            "rfc": self.rfc,
            "passed": self.passed,
            "failures": self.failures,
        }


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
) -> Comparison:
    """Compare `actual` with the reference `expected`.

    `axes` names the dimensions for the worst element's position; `positions` maps an axis to the
    original index of each of its entries, for results that are a selection of rows.
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
    ref_norm = float(np.sqrt(np.sum(b * b)))
    err_norm = float(np.sqrt(np.sum(error * error)))
    nrmse = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    comparison = Comparison(
        shape=a.shape,
        max_abs=float(error.max()),
        max_rel=float((error[nonzero] / np.abs(b[nonzero])).max()) if nonzero.any() else 0.0,
        n_outside=n_outside,
        share_outside=n_outside / a.size,
        margin=float(ratio.max()),
        nrmse=nrmse,
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
        nrmse_gated=tolerance.gates_nrmse(a.shape[0] if names[:1] == ("token",) else None),
        rfc={
            **rfc_tolerance.as_dict(),
            "n_outside": rfc_outside,
            "share_outside": rfc_outside / a.size,
            "margin": float(rfc_ratio.max()),
            "passed": rfc_outside == 0,
        },
        failures=[],
    )
    comparison.failures = _failures(comparison)
    return comparison


def _failures(c: Comparison) -> list[str]:
    tol = c.tolerance
    failures = []
    if c.nonfinite:
        failures.append(f"{c.nonfinite} NaN/Inf value(s) in the result")
    if c.n_outside:
        where = ", ".join(f"{name} {i}" for name, i in c.worst["index"].items())
        failures.append(
            f"{c.n_outside} of {int(np.prod(c.shape))} elements ({c.share_outside:.2%}) outside "
            f"{tol.atol:g} + {tol.rtol:g}*|ref|; worst at {where}: got {c.worst['actual']:.6g}, "
            f"expected {c.worst['expected']:.6g} (margin {c.margin:.3g})"
        )
    if c.nrmse_gated and not c.nrmse <= tol.max_nrmse:
        failures.append(f"normalised RMSE {c.nrmse:.3g} > {tol.max_nrmse:g}")
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
    )
