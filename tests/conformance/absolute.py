"""A result against its reference under the absolute gate alone, with no truth looked up: what most unit
tests of the judging engine need."""

from __future__ import annotations

from typing import Any

from conformance.judging.comparison import Comparison, judge
from conformance.judging.measurement import measure


def compare(*args: Any, **kwargs: Any) -> Comparison:
    """`measure(*args, **kwargs)` decided by the absolute gate."""
    return judge(measure(*args, **kwargs), "absolute")
