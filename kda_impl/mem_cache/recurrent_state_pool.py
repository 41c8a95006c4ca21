"""Per-request recurrent and conv states of every KDA layer, in slots (RFC §4.5).

The buffers are pytree children, so a jitted forward takes the pool as a (donated) argument and returns
the updated one. Slot bookkeeping (`alloc` / `free`) is host-side: an allocator shared by every
functional copy of the pool (it is the pool's static aux data).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.config import KDAConfig

DUMMY_SLOT = 0  # reserved for padding / idle requests; never handed out by `alloc`


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

    def free(self, slots: Sequence[int]) -> None:
        slots = [int(s) for s in np.asarray(slots).reshape(-1)]
        for slot in slots:
            check_slot_range(slot, self.num_slots)
        if len(set(slots)) != len(slots):
            raise ValueError(f"slot list {slots} frees a slot twice")
        unallocated = [slot for slot in slots if slot not in self._in_use]
        if unallocated:
            raise ValueError(f"slot(s) {unallocated} are not allocated (double free?)")
        self._in_use.difference_update(slots)
        self._free.extend(sorted(slots, reverse=True))


def check_slot_range(slot: int, num_slots: int) -> None:
    """ValueError naming `slot` unless it is a real slot 1..num_slots."""
    if not 1 <= slot <= num_slots:
        raise ValueError(
            f"slot {slot} is out of range: real slots are 1..{num_slots} (slot {DUMMY_SLOT} is the dummy)"
        )


@jax.tree_util.register_pytree_node_class
class RecurrentStatePool:
    """Recurrent + conv state buffers of the KDA layers `layer_ids`, one slot per live request.

    recurrent_buffer: `[L, slots+1, H, D, D]` fp32.
    conv_buffer: `[L, slots+1, W-1, 3P]` in the run's dtype; channels are q | k | v.
    Slot 0 is the dummy slot (padding and idle requests); a slot is zeroed when allocated.

    Host-side methods (`alloc`, `free`, `get_recurrent_indices`) run outside `jit`; `alloc` rebinds this
    object's buffers (after a donated forward, call it on the returned pool). The layer-cache methods
    are functional and jit-friendly.
    """

    def __init__(
        self,
        recurrent_buffer: jax.Array,  # [L, slots+1, H, D, D] fp32
        conv_buffer: jax.Array,  # [L, slots+1, W-1, 3P]
        layer_ids: tuple[int, ...],
        allocator: SlotAllocator,
    ):
        self.recurrent_buffer = recurrent_buffer
        self.conv_buffer = conv_buffer
        self.layer_ids = layer_ids
        self.allocator = allocator

    @classmethod
    def create(
        cls,
        config: KDAConfig,
        num_slots: int,
        dtype: Any = jnp.float32,
        layer_ids: Sequence[int] | None = None,
    ) -> RecurrentStatePool:
        """Zeroed buffers for `num_slots` requests of the (0-based) KDA layers `layer_ids`.

        `layer_ids` defaults to the config's KDA layers.
        """
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if layer_ids is None:
            layer_ids = [i for i in range(config.num_hidden_layers) if config.is_kda_layer(i)]
            if not layer_ids:
                raise ValueError(
                    f"config {config.preset!r} names no KDA layers (kda_layers={config.kda_layers}); "
                    "pass layer_ids"
                )
        layer_ids = tuple(int(i) for i in layer_ids)
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids {layer_ids} repeat a layer")
        num_layers, h, d = len(layer_ids), config.num_heads, config.head_dim
        recurrent = jnp.zeros((num_layers, num_slots + 1, h, d, d), jnp.float32)
        conv = jnp.zeros((num_layers, num_slots + 1, config.conv_size - 1, config.conv_dim), dtype)
        return cls(recurrent, conv, layer_ids, SlotAllocator(num_slots))

    # --- pytree -------------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array], tuple[tuple[int, ...], SlotAllocator]]:
        return (self.recurrent_buffer, self.conv_buffer), (self.layer_ids, self.allocator)

    @classmethod
    def tree_unflatten(
        cls, aux: tuple[tuple[int, ...], SlotAllocator], children: tuple
    ) -> RecurrentStatePool:
        return cls(*children, *aux)

    # --- host-side slot bookkeeping -----------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Real slots (1..num_slots); the buffers have one more row, the dummy slot 0."""
        return self.allocator.num_slots

    def alloc(self, n: int) -> np.ndarray:
        """Reserve `n` free slots, zero their states in every layer, and return them as i32[n]."""
        slots = self.allocator.alloc(n)
        if n:
            # Pad the ids to a power of two with the dummy slot: one compilation per size class.
            padded = np.full(1 << (n - 1).bit_length(), DUMMY_SLOT, np.int32)
            padded[:n] = slots
            self.recurrent_buffer, self.conv_buffer = _zero_slots(
                self.recurrent_buffer, self.conv_buffer, jnp.asarray(padded)
            )
        return slots

    def free(self, slots: Sequence[int] | np.ndarray) -> None:
        """Return `slots` to the free list (ValueError on an out-of-range, unallocated or repeated slot)."""
        self.allocator.free(slots)

    def get_recurrent_indices(self, req_pool_indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The pool slots `i32[N]` of the requests holding slots `req_pool_indices` (slot = request index).

        ValueError naming the slot when one is out of range or not allocated.
        """
        slots = np.asarray(req_pool_indices)
        if slots.ndim != 1 or not np.issubdtype(slots.dtype, np.integer):
            raise ValueError(f"req_pool_indices must be a 1-D list of integers, got {slots!r}")
        for slot in slots.tolist():
            check_slot_range(slot, self.num_slots)
            if not self.allocator.is_allocated(slot):
                raise ValueError(f"slot {slot} is not allocated; allocate it with RecurrentStatePool.alloc")
        return slots.astype(np.int32)

    # --- per-layer access (jit-friendly) ------------------------------------------------------------

    def layer_index(self, layer_id: int) -> int:
        """Row of the buffers holding (0-based, model-wide) layer `layer_id`."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} has no state in this pool; it holds layers {self.layer_ids}"
            ) from None

    def get_linear_recurrent_layer_cache(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        """`(recurrent [slots+1, H, D, D] fp32, conv [slots+1, W-1, 3P])` of one layer."""
        i = self.layer_index(layer_id)
        return self.recurrent_buffer[i], self.conv_buffer[i]

    def set_linear_recurrent_layer_cache(
        self,
        layer_id: int,
        slot_indices: jax.Array,  # i32[N]
        new_recurrent: jax.Array,  # [N, H, D, D]
        new_conv: jax.Array,  # [N, W-1, 3P]
    ) -> RecurrentStatePool:
        """A pool whose `slot_indices` of layer `layer_id` hold the new states (the rest unchanged).

        Under `jit` with the pool donated, XLA updates the buffers in place.
        """
        i = self.layer_index(layer_id)
        n = slot_indices.shape[0]
        if new_recurrent.shape != (n, *self.recurrent_buffer.shape[2:]):
            raise ValueError(
                f"new_recurrent must be [N={n}, H, D, D]={(n, *self.recurrent_buffer.shape[2:])}, "
                f"got {new_recurrent.shape}"
            )
        if new_conv.shape != (n, *self.conv_buffer.shape[2:]):
            raise ValueError(
                f"new_conv must be [N={n}, W-1, 3P]={(n, *self.conv_buffer.shape[2:])}, got {new_conv.shape}"
            )
        recurrent = self.recurrent_buffer.at[i, slot_indices].set(
            new_recurrent.astype(self.recurrent_buffer.dtype)
        )
        conv = self.conv_buffer.at[i, slot_indices].set(new_conv.astype(self.conv_buffer.dtype))
        return RecurrentStatePool(recurrent, conv, self.layer_ids, self.allocator)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _zero_slots(
    recurrent: jax.Array,  # [L, slots+1, H, D, D]
    conv: jax.Array,  # [L, slots+1, W-1, 3P]
    slots: jax.Array,  # i32[n]
) -> tuple[jax.Array, jax.Array]:
    return recurrent.at[:, slots].set(0), conv.at[:, slots].set(0)
