"""A result against its reference under the absolute gate alone, with no truth looked up: what most unit
tests of the judging engine need."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from conformance.judging.comparison import Comparison, judge
from conformance.judging.measurement import measure
from conformance.judging.tolerances import Tolerance


def compare(
    actual: np.ndarray,
    expected: np.ndarray,  # the shape of `actual`
    tolerance: Tolerance,
    rfc_tolerance: Tolerance,
    axes: tuple[str, ...] = (),
    positions: dict[str, np.ndarray] | None = None,
    seq_lens: Sequence[int] | None = None,
    min_tokens: int = 0,
) -> Comparison:
    """`measure` decided by the absolute gate."""
    measured = measure(actual, expected, tolerance, rfc_tolerance, axes, positions, seq_lens, min_tokens)
    return judge(measured, "absolute")
