"""Seeded serving defects: the built-in adapter with one scheduler-path bug each, of the kinds linear
attention serving stacks shipped (docs/serving.md). Each is its own adapter (`--impl
conformance.adapters.serving_defects:NAME`), a `backend_class` or `serving_pool_class` swap, so that the
per-case checks run the same layer as the built-in one; the serving scenarios catch each.

- `StaleRecycledSlot`: a slot is handed out without clearing it, so a new request on a recycled slot
  starts from the finished request's states.
- `OneTokenSegmentAsNew`: in an EXTEND batch, a 1-token segment of a running request (position > 0)
  starts from zero states, as if it were a new request.
- `OneTokenConvLookbackZeros`: the same segment's short conv looks back on zeros (its recurrent state
  is kept).
- `ShiftedDecodeSlots`: in an EXTEND batch, the 1-token rows after a prefill row take each other's
  slots (rotated by one).
- `PaddingWritesSlot`: the first padding row of a batch runs on the pool's last real slot instead of
  the dummy slot, and writes its state there.

The per-case checks never schedule a running request's token beside a prefill, never reuse a slot
without writing its starting state, and never read a slot outside their batch, so every one of these
passes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from kda_impl.kernels.slots import DUMMY_SLOT
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.layers.short_conv import short_conv_with_state
from kda_impl.mem_cache.recurrent_state_pool import CONV_SPEC, RECURRENT_SPEC, RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from kda_impl.layers.radix_linear_attention import RadixLinearAttention
    from kda_impl.model_executor.forward_batch import ForwardBatch


# ------------------------------------------------------------------------------------- stale slot


@jax.tree_util.register_pytree_node_class
class UnclearedPool(RecurrentStatePool):
    """A pool whose `alloc` hands out slots as they are: a recycled one keeps its last request's states."""

    def alloc(self, n: int, dp_rank: int = 0) -> np.ndarray:
        return self._allocator(dp_rank).alloc(n)

    def replace(self, **buffers: jax.Array) -> UnclearedPool:
        pool = super().replace(**buffers)
        return UnclearedPool(pool.recurrent_buffer, pool.conv_buffer, self.layer_ids, self.allocators)

    def partition_specs(self) -> UnclearedPool:
        return UnclearedPool(RECURRENT_SPEC, CONV_SPEC, self.layer_ids, self.allocators)


class StaleRecycledSlot(KDAImplAdapter):
    name = "kda_impl with a recycled slot's stale state"
    serving_pool_class = UnclearedPool


# --------------------------------------------------------------------- running 1-token segments


def running_one_token_segments(forward_batch: ForwardBatch, cu_q_lens: jax.Array) -> jax.Array:
    """bool[N]: the requests of an EXTEND batch with one token at a position > 0 (a running request's
    next token)."""
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    first = forward_batch.positions[jnp.clip(cu_q_lens[:-1], 0, forward_batch.positions.shape[0] - 1)]
    return (lens == 1) & (first > 0)


class _ZeroedConvLookback(KDAAttnBackend):
    """A backend whose EXTEND short conv starts the running 1-token segments from a zero conv state."""

    def apply_short_conv(
        self,
        layer: RadixLinearAttention,
        forward_batch: ForwardBatch,
        mixed_qkv: jax.Array,  # [T, 3P]
        conv_weight: jax.Array,  # [W, 3P]
        recurrent_state_pool: RecurrentStatePool,
    ) -> tuple[jax.Array, jax.Array]:
        if forward_batch.forward_mode != ForwardMode.EXTEND:
            return super().apply_short_conv(
                layer, forward_batch, mixed_qkv, conv_weight, recurrent_state_pool
            )
        metadata = self._metadata()
        _, conv_state = recurrent_state_pool.get_slot_states(
            layer.layer_id, metadata.recurrent_indices, padding_rows=True
        )
        num_seqs, history = conv_state.shape[:2]
        zeroed = running_one_token_segments(forward_batch, metadata.cu_q_lens)[:, None, None]
        conv_state = jnp.where(zeroed, 0, conv_state.reshape(num_seqs, history, -1))
        return short_conv_with_state(mixed_qkv, conv_weight, conv_state, metadata.cu_q_lens)


@jax.tree_util.register_pytree_node_class
class ZeroConvLookbackBackend(_ZeroedConvLookback):
    """`OneTokenConvLookbackZeros`' backend."""


@jax.tree_util.register_pytree_node_class
class OneTokenAsNewBackend(_ZeroedConvLookback):
    """The conv lookback zeroed and the recurrence started from zeros for a running 1-token segment."""

    def forward(
        self,
        layer: RadixLinearAttention,
        forward_batch: ForwardBatch,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        new_conv_state: jax.Array,
        recurrent_state_pool: RecurrentStatePool,
    ) -> tuple[jax.Array, RecurrentStatePool]:
        pool = recurrent_state_pool
        if forward_batch.forward_mode == ForwardMode.EXTEND:
            metadata = self._metadata()
            slots = metadata.recurrent_indices
            recurrent, conv = pool.get_slot_states(layer.layer_id, slots, padding_rows=True)
            fresh = running_one_token_segments(forward_batch, metadata.cu_q_lens)[:, None, None, None]
            recurrent = jnp.where(fresh, 0, recurrent)
            pool = pool.set_linear_recurrent_layer_cache(
                layer.layer_id, slots, recurrent, conv, padding_rows=True
            )
        return super().forward(layer, forward_batch, q, k, v, g, beta, new_conv_state, pool)


class OneTokenSegmentAsNew(KDAImplAdapter):
    name = "kda_impl with a running 1-token EXTEND segment taken as a new request"
    backend_class = OneTokenAsNewBackend


class OneTokenConvLookbackZeros(KDAImplAdapter):
    name = "kda_impl with a running 1-token EXTEND segment's conv lookback taken as zeros"
    backend_class = ZeroConvLookbackBackend


# --------------------------------------------------------------------------------- slot indices


class _MovedSlots(KDAAttnBackend):
    """A backend whose forward metadata runs rows on other slots than the scheduler gave them."""

    def move(self, mode: ForwardMode, lens: np.ndarray, slots: np.ndarray, num_slots: int) -> bool:
        """Move rows of the batch (`lens` tokens each) to other slots in `slots`, a copy of the scheduler's
        (`num_slots` in the pool); whether it moved any."""
        raise NotImplementedError

    def get_forward_metadata(self, forward_mode, seq_lens, recurrent_indices, *, num_slots) -> Any:
        metadata = super().get_forward_metadata(
            forward_mode, seq_lens, recurrent_indices, num_slots=num_slots
        )
        slots = np.array(recurrent_indices)
        if not self.move(forward_mode, np.asarray(seq_lens), slots, num_slots):
            return metadata
        return type(metadata)(cu_q_lens=metadata.cu_q_lens, recurrent_indices=jnp.asarray(slots, jnp.int32))


@jax.tree_util.register_pytree_node_class
class ShiftedSlotsBackend(_MovedSlots):
    """EXTEND metadata whose 1-token rows after a prefill row take the slot of the next such row."""

    def move(self, mode: ForwardMode, lens: np.ndarray, slots: np.ndarray, num_slots: int) -> bool:
        if mode != ForwardMode.EXTEND or not np.any(lens > 1):
            return False
        after = np.flatnonzero(
            (lens == 1) & (np.arange(lens.size) > np.argmax(lens > 1)) & (slots != DUMMY_SLOT)
        )
        slots[after] = np.roll(slots[after], -1)
        return True


class ShiftedDecodeSlots(KDAImplAdapter):
    name = "kda_impl with the slots of decode rows after a prefill shifted"
    backend_class = ShiftedSlotsBackend


@jax.tree_util.register_pytree_node_class
class PaddingWritesBackend(_MovedSlots):
    """Metadata whose first padding row runs on the last real slot when no request of the batch holds it."""

    def move(self, mode: ForwardMode, lens: np.ndarray, slots: np.ndarray, num_slots: int) -> bool:
        padding = np.flatnonzero(slots == DUMMY_SLOT)
        if padding.size == 0 or num_slots in slots:
            return False
        slots[padding[0]] = num_slots
        return True


class PaddingWritesSlot(KDAImplAdapter):
    name = "kda_impl with a padding row that writes a real slot"
    backend_class = PaddingWritesBackend


SERVING_DEFECTS = (
    StaleRecycledSlot,
    OneTokenSegmentAsNew,
    OneTokenConvLookbackZeros,
    ShiftedDecodeSlots,
    PaddingWritesSlot,
)
