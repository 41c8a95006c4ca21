"""Results computed once and shared by the checks that need them."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class Memo:
    """compute() once per key; a failure too, so that the checks sharing it do not repeat it: raised
    again to each (afresh where the error has a `fresh()`, else with its traceback cleared), so that
    no traceback grows."""

    def __init__(self) -> None:
        self._values: dict[Hashable, tuple[bool, Any]] = {}

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        if key not in self._values:
            try:
                self._values[key] = (True, compute())
            except Exception as err:
                self._values[key] = (False, err)
        ok, value = self._values[key]
        if ok:
            return value
        raise value.fresh() if hasattr(value, "fresh") else value.with_traceback(None)

    def clear(self) -> None:
        self._values.clear()
