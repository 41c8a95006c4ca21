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
passes them. Four more are bugs of the serving protocol's optional verbs (a `serving_class` swap: the
scheduler glue, or the pool's accept), which every check before them passes, since none copies, loads,
verifies or reads a free slot; the scenarios of those verbs catch each:

- `SnapshotAfterPartialChunk`: a copy from a request is published after that request's next forward
  (the state after the next, partial chunk: 130 tokens instead of the boundary's 128).
- `AcceptForgetsConvShift`: an accept keeps the recurrent state after the accepted drafts but leaves
  the conv window where it was before the verify.
- `HandoffRepeatsLastToken`: the decode side of a handoff runs the last prefill token again on the
  states it imported (which already hold it).
- `PaddingWrapsToLastSlot`: the first padding request's slot index -1 wraps to the pool's last slot
  when that slot is free, and writes it (free slots are cleared when allocated, so only a check that
  reads a free slot sees it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.adapters.kda_impl_serving import KDAImplServing
from kda_impl.kernels.slots import DUMMY_SLOT
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.layers.short_conv import short_conv_with_state
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from kda_impl.layers.radix_linear_attention import RadixLinearAttention
    from kda_impl.model_executor.forward_batch import ForwardBatch


# ------------------------------------------------------------------------------------- stale slot


@jax.tree_util.register_pytree_node_class
class UnclearedPool(RecurrentStatePool):
    """A pool whose `alloc` hands out slots as they are: a recycled one keeps its last request's states."""

    def alloc(self, n: int, dp_rank: int = 0) -> np.ndarray:
        return self._allocator(dp_rank).alloc(n)


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


# ------------------------------------------------------------------------ the optional verbs' defects


class DeferredSnapshotServing(KDAImplServing):
    """Copies published late: after the source's next forward, or before anything else uses them."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[int, int]] = []  # (src, dst) slots

    def publish(self, ready: list[tuple[int, int]]) -> None:
        self.pending = [pair for pair in self.pending if pair not in ready]
        for src, dst in ready:
            super().copy(src, dst)

    def copy(self, src: int, dst: int) -> None:
        self.publish([pair for pair in self.pending if src in pair or dst in pair])
        self.pending.append((src, dst))

    def run(self, mode: str, hidden_states, seq_lens, slots, prefix_lens, padding_rows) -> np.ndarray:
        self.publish([pair for pair in self.pending if pair[1] in slots])
        out = super().run(mode, hidden_states, seq_lens, slots, prefix_lens, padding_rows)
        self.publish([pair for pair in self.pending if pair[0] in slots])
        return out

    def free(self, slot: int) -> None:
        self.publish([pair for pair in self.pending if slot in pair])
        super().free(slot)


class SnapshotAfterPartialChunk(KDAImplAdapter):
    name = "kda_impl with a snapshot published after the next chunk instead of at the boundary"
    serving_class = DeferredSnapshotServing


@jax.tree_util.register_pytree_node_class
class ConvKeepingPool(RecurrentStatePool):
    """A pool whose `accept_drafts` keeps the recurrent state after the accepted drafts, the conv
    window from before the verify."""

    def accept_drafts(self, slots: Any, accepted: Any, dp_rank: int = 0) -> ConvKeepingPool:
        conv = jnp.array(self.conv_buffer, copy=True)  # the accept donates the buffer
        return super().accept_drafts(slots, accepted, dp_rank).replace(conv_buffer=conv)


class AcceptForgetsConvShift(KDAImplAdapter):
    name = "kda_impl with an accept that keeps the conv window of before the verify"
    serving_pool_class = ConvKeepingPool


class LastTokenShippingServing(KDAImplServing):
    """Each export (`state`) ships the slot's last token and its position beside the states
    (`shipped`, kept across pools by the adapter); a load of shipped states runs that token again."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.last: dict[int, tuple[np.ndarray, int]] = {}  # slot -> (hidden [hidden], tokens processed)
        self.shipped: dict[bytes, tuple[np.ndarray, int]] = {}

    def run(self, mode: str, hidden_states, seq_lens, slots, prefix_lens, padding_rows) -> np.ndarray:
        out = super().run(mode, hidden_states, seq_lens, slots, prefix_lens, padding_rows)
        ends = np.cumsum(seq_lens)
        for slot, end, prefix, n in zip(slots.tolist(), ends.tolist(), prefix_lens, seq_lens):
            self.last[slot] = (hidden_states[end - 1], int(prefix + n))
        return out

    def state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        recurrent, conv = super().state(slot)
        if slot in self.last:
            self.shipped[recurrent.tobytes()] = self.last[slot]
        return recurrent, conv

    def load(self, slot: int, recurrent: np.ndarray, conv: np.ndarray) -> None:
        super().load(slot, recurrent, conv)
        shipped = self.shipped.get(np.asarray(recurrent, np.float32).tobytes())
        if shipped is not None:
            token, processed = shipped
            one = np.ones(1, np.int64)
            self.run("extend", token[None], one, np.array([slot]), np.array([processed - 1]), 0)


class HandoffRepeatsLastToken(KDAImplAdapter):
    name = "kda_impl with a handoff whose decode side runs the last prefill token again"
    serving_class = LastTokenShippingServing

    def serving_open(self, num_slots: int) -> None:
        shipped = self._serving.shipped if isinstance(self._serving, LastTokenShippingServing) else {}
        super().serving_open(num_slots)
        self._serving.shipped.update(shipped)


class WrappedPaddingServing(KDAImplServing):
    """Batches whose first padding request runs on the pool's last slot (index -1) when it is free."""

    def batch(self, forward_mode, seq_lens, slots, prefix_lens, rows, padding_rows) -> ForwardBatch:
        batch = super().batch(forward_mode, seq_lens, slots, prefix_lens, rows, padding_rows)
        last = self.pool.num_slots
        if self.pool.allocators[0].is_allocated(last):
            return batch
        metadata = batch.attn_backend.forward_metadata
        indices = np.array(metadata.recurrent_indices)
        indices[len(seq_lens)] = last  # the first padding request
        moved = type(metadata)(cu_q_lens=metadata.cu_q_lens, recurrent_indices=jnp.asarray(indices))
        return batch.replace(attn_backend=batch.attn_backend.with_forward_metadata(moved))


class PaddingWrapsToLastSlot(KDAImplAdapter):
    name = "kda_impl with a padding index that wraps to the last slot when it is free"
    serving_class = WrappedPaddingServing


SERVING_DEFECTS = (
    StaleRecycledSlot,
    OneTokenSegmentAsNew,
    OneTokenConvLookbackZeros,
    ShiftedDecodeSlots,
    PaddingWritesSlot,
    SnapshotAfterPartialChunk,
    AcceptForgetsConvShift,
    HandoffRepeatsLastToken,
    PaddingWrapsToLastSlot,
)
