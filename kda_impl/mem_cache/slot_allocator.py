"""Host-side slot bookkeeping of the recurrent state pool: one free list per data rank."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kda_impl.kernels.slots import as_int_array, check_request_slots, first_repeat, is_int


class PoolExhaustedError(RuntimeError):
    """`alloc` asked for more slots than are free."""


class SlotAllocator:
    """Host-side free list of the slots 1..num_slots. Identity equality: one per pool family."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # pop() hands out the lowest slot first
        self._in_use: set[int] = set()

    def is_allocated(self, slot: int) -> bool:
        return slot in self._in_use

    def alloc(self, n: int) -> np.ndarray:
        if not is_int(n):
            raise ValueError(f"alloc needs a whole number of slots (an int), got n={n!r}")
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots, got n={n}")
        if n > len(self._free):
            raise PoolExhaustedError(
                f"recurrent state pool exhausted: {n} slot(s) requested, {len(self._free)} free "
                f"of {self.num_slots}; free finished requests or build a larger pool"
            )
        slots = [self._free.pop() for _ in range(n)]
        self._in_use.update(slots)
        return np.asarray(slots, dtype=np.int32)

    def free(self, slots: Sequence[int] | np.ndarray) -> None:
        array = as_int_array(slots, "slots").reshape(-1)
        repeated = first_repeat(array)
        if repeated is not None:
            raise ValueError(f"slot list {array.tolist()} frees slot {repeated} twice")
        check_request_slots(array, self.num_slots)
        slots = array.tolist()
        unallocated = [slot for slot in slots if slot not in self._in_use]
        if unallocated:
            raise ValueError(f"slot(s) {unallocated} are not allocated (double free?)")
        self._in_use.difference_update(slots)
        self._free.extend(sorted(slots, reverse=True))
