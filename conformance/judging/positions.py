"""Error against the float64 truth as a function of position, for the long cases (group `long`).

A long case's output (one prefill, or a prefill then token-by-token decode steps) is cut into windows of
`WINDOW_TOKENS` tokens; in each, the implementation's and the reference's own errors against the float64
truth are measured (worst and RMS absolute error, and the margin and nRMSE the relative gate uses), and
the relative gate (docs/tolerance-policy.md, "The relative gate") is applied window by window, with the
policy's `[relative.<dtype>]` numbers: a check holds when every window does. `write_files` puts the
curves beside report.md as positions.json, positions.csv and, with matplotlib, positions.png.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conformance.judging.attribution import Attribution, attribute
from conformance.judging.comparison import Comparison, judge
from conformance.judging.limits import RelativeLimits, Tolerance
from conformance.judging.measurement import Measurement, elements_outside
from conformance.judging.verdict import Criterion, worst_ratio

WINDOW_TOKENS = 256
# The gate of a position check is always the relative one, window by window: over tens of thousands of
# tokens the question is whether the implementation drifts from the truth faster than the reference.
POSITIONS_MODE = "relative"


@dataclasses.dataclass(frozen=True)
class Window:
    """One window of tokens `[start, end)`: both sides' errors against the truth, and the gate on them."""

    start: int
    end: int
    impl_rms: float
    reference_rms: float
    attribution: Attribution

    @property
    def passed(self) -> bool:
        return all(criterion.holds for criterion in self.attribution.criteria)


@dataclasses.dataclass(frozen=True)
class PositionProfile:
    """The windows of one long case's output in one dtype; `decode_from`: the first decoded token."""

    case_id: str
    dtype: str
    check: str
    window_tokens: int
    decode_from: int | None
    windows: tuple[Window, ...]

    @property
    def worst(self) -> Window:
        """The window furthest over (or nearest to) the relative gate's limit."""
        return max(self.windows, key=lambda w: np.nan_to_num(worst_ratio(w.attribution.criteria), nan=np.inf))

    @property
    def failed(self) -> list[Window]:
        return [window for window in self.windows if not window.passed]


def window_bounds(tokens: int, window_tokens: int) -> list[tuple[int, int]]:
    """`[start, end)` of consecutive windows of `window_tokens` tokens; the last may be shorter."""
    if window_tokens < 1:
        raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
    return [(start, min(start + window_tokens, tokens)) for start in range(0, tokens, window_tokens)]


def _rms(x: np.ndarray, truth: np.ndarray) -> float:
    error = np.where(np.isfinite(x), x - truth, np.inf)
    return float(np.sqrt(np.mean(error * error)))


def position_profile(
    actual: np.ndarray,
    expected: np.ndarray,
    truth: np.ndarray,
    tolerance: Tolerance,
    limits: RelativeLimits,
    *,
    case_id: str,
    dtype: str,
    check: str,
    decode_from: int | None = None,
    window_tokens: int = WINDOW_TOKENS,
) -> PositionProfile:
    """`actual` (the implementation's output [T, hidden]) and `expected` (the reference's) against their
    float64 `truth`, window by window of tokens (rows). A window is out of tolerance when the two sides
    differ by more than `tolerance` in it, as a whole check is (`attribution.attribute`)."""
    a, b, t = (np.asarray(x, np.float64) for x in (actual, expected, truth))
    if not a.shape == b.shape == t.shape or a.ndim < 1:
        raise ValueError(
            f"case {case_id} ({dtype}) {check}: result {a.shape}, reference {b.shape} and truth {t.shape} "
            "must have one shape with a token axis first"
        )
    windows = []
    for start, end in window_bounds(a.shape[0], window_tokens):
        rows = slice(start, end)
        outside = elements_outside(a[rows], b[rows], tolerance) > 0
        attribution = attribute(
            a[rows], b[rows], t[rows], f"out truth, tokens {start}-{end}", tolerance, limits, outside
        )
        windows.append(Window(start, end, _rms(a[rows], t[rows]), _rms(b[rows], t[rows]), attribution))
    return PositionProfile(case_id, dtype, check, window_tokens, decode_from, tuple(windows))


def judge_by_windows(measured: Measurement, profile: PositionProfile, source: str) -> Comparison:
    """Decide `measured` (the whole output against the reference) by the relative gate of every window:
    the worst window's criteria decide (every window holds when it does), and a failure names each
    window over the limit."""
    worst = profile.worst
    attribution = dataclasses.replace(
        worst.attribution,
        source=f"{source}, tokens {worst.start}-{worst.end}: the worst of {len(profile.windows)} windows",
    )
    failed = profile.failed
    where = ", ".join(f"{w.start}-{w.end}" for w in failed[:8]) + (" …" if len(failed) > 8 else "")
    windows = (
        f"{len(failed)} of {len(profile.windows)} windows of {profile.window_tokens} tokens over the "
        f"relative gate (tokens {where}); the worst, {worst.start}-{worst.end}"
    )
    return judge(
        measured, POSITIONS_MODE, attribution, relative=_with_windows(attribution, windows, measured)
    )


def _with_windows(attribution: Attribution, windows: str, measured: Measurement) -> tuple[Criterion, ...]:
    """The worst window's relative criteria, the first that fails prefixed with which windows fail; no
    prefix where the result holds NaN/Inf (the finite criterion says so, and every window fails by it)."""
    criteria, prefixed = [], measured.nonfinite > 0
    for criterion in attribution.criteria:
        if not criterion.holds and not prefixed:
            criterion, prefixed = (
                dataclasses.replace(criterion, detail=f"{windows}: {criterion.statement()}"),
                True,
            )
        criteria.append(criterion)
    return tuple(criteria)
