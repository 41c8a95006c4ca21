"""The slot-index contract shared by the recurrent state pool, the backend and the decode kernels.

A state buffer has one row (slot) per request; slot `DUMMY_SLOT` (0) is reserved for padding rows.
In one batch, real requests use distinct slots other than the dummy; padding rows may all use the dummy.

- Host side (outside `jit`): `as_int_array` refuses floats and bools instead of truncating them, and
  `check_request_slots` refuses out-of-range, reserved and repeated slots with a ValueError naming the
  slot and the pool size.
- Inside `jit`, where no value can be checked: `route_unsafe_slots_to_dummy` sends every index outside
  the buffer, and every repeated non-dummy index, to the dummy slot, so that no index can alias another
  request's slot (JAX's gathers clamp and its scatters wrap negative indices, which would).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DUMMY_SLOT = 0  # reserved for padding / idle rows; never a real request's


def as_int_array(values: Any, name: str) -> np.ndarray:
    """`values` (Python ints or an integer array, any shape) as an int64 array.

    ValueError naming `name` for any float (2.0 included: a float index is a bug upstream, and casting
    would truncate 1.7 to 1) and any bool (True would read as slot 1).
    """
    if hasattr(values, "dtype") and hasattr(values, "shape"):  # a numpy or jax array / scalar
        array = np.asarray(values)
        if array.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got dtype {array.dtype}: {_short(array.tolist())}")
        return array.astype(np.int64)
    try:
        elements = np.asarray(values, dtype=object)
    except ValueError as err:
        raise ValueError(f"{name} must be integers, got {_short(values)}: {err}") from None
    for element in elements.reshape(-1):
        if isinstance(element, (bool, np.bool_)) or not isinstance(element, (int, np.integer)):
            raise ValueError(
                f"{name} must be integers (Python ints or an integer array), got {element!r} "
                f"in {_short(values)}"
            )
    try:
        return elements.astype(np.int64)
    except OverflowError:
        raise ValueError(f"{name} {_short(values)} do not fit in int64") from None


def is_int(value: Any) -> bool:
    """Whether `value` is a Python or numpy integer (a bool is not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_request_slots(slots: np.ndarray, num_slots: int, *, padding_rows: bool = False) -> None:
    """ValueError naming the slot and the pool size unless every slot of `slots` (int, 1-D) is a real
    slot 1..num_slots and no slot repeats.

    With `padding_rows`, a row on the dummy slot is a padding row: allowed, any number of times.
    """
    for slot in slots.tolist():
        if not (padding_rows and slot == DUMMY_SLOT) and not 1 <= slot <= num_slots:
            raise ValueError(
                f"slot {slot} is out of range: real slots are 1..{num_slots} of the {num_slots}-slot "
                f"pool (slot {DUMMY_SLOT} is the reserved dummy)"
            )
    repeated = first_repeat(slots[slots != DUMMY_SLOT])
    if repeated is not None:
        raise ValueError(
            f"slot {repeated} is given to two requests of one batch: each request needs its own slot "
            f"of the {num_slots}-slot pool"
        )


def first_repeat(values: np.ndarray) -> int | None:
    """The first value of `values` that occurs twice, or None."""
    seen: set[int] = set()
    for value in values.tolist():
        if value in seen:
            return value
        seen.add(value)
    return None


def check_integer_indices(slot_indices: Any, name: str = "slot_indices") -> None:
    """ValueError naming `name` unless the indices' dtype is integer (a static check: works while tracing)."""
    dtype = slot_indices.dtype if hasattr(slot_indices, "dtype") else np.asarray(slot_indices).dtype
    if np.dtype(dtype).kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {dtype}")


def route_unsafe_slots_to_dummy(
    slot_indices: jax.Array,  # int[N] rows of a slot axis of `num_rows` rows
    num_rows: int,
    *,
    block: int | None = None,
) -> jax.Array:
    """i32[N]: `slot_indices` with every unsafe index replaced by `DUMMY_SLOT` (jit-friendly).

    Unsafe: outside `0..num_rows-1` (negative ones included), or a non-dummy row that occurs more than
    once (every occurrence goes: which request owns the row cannot be told). The rows that are multiples
    of `block` (default `num_rows`: only row 0) are dummy rows, which padding rows may share. Such a
    request then reads and writes the dummy slot only: its own output is meaningless, no real slot is
    read or written.
    """
    check_integer_indices(slot_indices)
    block = num_rows if block is None else block
    indices = jnp.asarray(slot_indices).astype(jnp.int32)
    in_range = (indices >= 0) & (indices < num_rows)
    safe = jnp.where(in_range, indices, DUMMY_SLOT)
    uses = jnp.zeros(num_rows, jnp.int32).at[safe].add(1)
    repeated = (uses[safe] > 1) & (safe % block != DUMMY_SLOT)
    return jnp.where(repeated, DUMMY_SLOT, safe)


def _short(values: Any, limit: int = 80) -> str:
    text = repr(values)
    return text if len(text) <= limit else text[: limit - 3] + "..."
