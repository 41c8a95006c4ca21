"""Per-request recurrent and conv states of every KDA layer, in slots (RFC §4.5).

The buffers are pytree children, so a jitted forward takes the pool as a (donated) argument and returns
the updated one. Slot bookkeeping (`alloc` / `free`) is host-side: one allocator per data rank, shared by
every functional copy of the pool (`replace`). The allocators are not part of the pytree: its static data
is the pool's shape (`SlotLayout`), so that every pool of one shape shares the compiled programs. A pool
that comes out of a jax transformation holds no allocators until `with_allocators_of` gives it those of
the pool that went in (`kimi_linear.jit_forward` does); its host-side slot methods refuse until then.

On a mesh (`kda_impl.parallel`) the buffers are sharded along heads over `tensor` and along slots over
`data`: data rank r owns the rows `r * (num_slots + 1) + [0, num_slots]`, row 0 of its block being its
own dummy slot. Inside the layer's `shard_map` each device sees one block with the rank's local slots.

Slot contract (`kda_impl.kernels.slots`): a real request's slot is one of 1..num_slots of its rank, never
shared with another request of the batch; padding rows use the dummy slot. Host-side methods refuse any
other slot with a ValueError; under `jit` the layer-cache methods route an out-of-range or repeated row
to the dummy slot, so that it reads and writes no real request's state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kda_impl.kernels.slots import (
    DUMMY_SLOT,
    as_int_array,
    check_integer_indices,
    check_request_slots,
    first_repeat,
    is_int,
    route_unsafe_slots_to_dummy,
)
from kda_impl.mem_cache.slot_allocator import PoolExhaustedError as PoolExhaustedError  # raised by alloc
from kda_impl.mem_cache.slot_allocator import SlotAllocator
from kda_impl.parallel.mesh import DATA_AXIS, TENSOR_AXIS, check_heads_divisible, mesh_sizes
from kda_spec.config import KDAConfig

# Layouts of the buffers on a mesh: slots over `data`, heads (or head-major channels) over `tensor`.
RECURRENT_SPEC = PartitionSpec(None, DATA_AXIS, TENSOR_AXIS, None, None)  # [L, slots, H, K, V]
CONV_SPEC = PartitionSpec(None, DATA_AXIS, None, None, TENSOR_AXIS)  # [L, slots, W-1, 3, P]
# The draft buffers (a verify forward's states after each draft token): one more axis after the slots.
DRAFT_RECURRENT_SPEC = PartitionSpec(None, DATA_AXIS, None, TENSOR_AXIS, None, None)  # [L, slots, k, H, K, V]
DRAFT_CONV_SPEC = PartitionSpec(None, DATA_AXIS, None, None, None, TENSOR_AXIS)  # [L, slots, k, W-1, 3, P]


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """A pool's slot shape, its pytree's static data: real slots per data rank, and data ranks."""

    num_slots: int
    dp_size: int


@jax.tree_util.register_pytree_node_class
class RecurrentStatePool:
    """Recurrent + conv state buffers of the KDA layers `layer_ids`, one slot per live request.

    recurrent_buffer: `[L, dp * (slots+1), H, D, D]` fp32.
    conv_buffer: `[L, dp * (slots+1), W-1, 3, P]` in the run's dtype: the last W-1 inputs of the q, k
    and v convs, `P = H * D` head-major channels each (so that heads can be split across devices).
    Each data rank's slot 0 is its dummy slot (padding and idle requests); a slot is zeroed when allocated.
    draft_recurrent_buffer / draft_conv_buffer (speculative decoding, `with_draft_tokens(k)`; None until
    then): `[L, dp * (slots+1), k, ...]`, each slot's states after each of its last verify forward's k
    draft tokens (`TARGET_VERIFY`), of which `accept_drafts` keeps the one after the n accepted.

    Host-side methods (`alloc`, `free`, `get_recurrent_indices`, `rows`) run outside `jit` and take the
    data rank of the request (0 without data parallelism); `alloc` rebinds this object's buffers (after a
    donated forward, call it on the returned pool). The layer-cache methods are functional and
    jit-friendly; their slot indices are rows of the buffers as the caller sees them: the rank's local
    slots inside the sharded forward, `rows(slots, dp_rank)` outside it. Outside `jit` they refuse a
    dummy, out-of-range or repeated row; inside it they route such a row to the dummy slot (`safe_rows`).
    """

    def __init__(
        self,
        recurrent_buffer: jax.Array,  # [L, dp * (slots+1), H, D, D] fp32
        conv_buffer: jax.Array,  # [L, dp * (slots+1), W-1, 3, P]
        layer_ids: tuple[int, ...],
        allocators: tuple[SlotAllocator, ...] | SlotLayout,  # one per data rank; a layout: none yet
        draft_recurrent_buffer: jax.Array | None = None,  # [L, dp * (slots+1), k, H, D, D] fp32
        draft_conv_buffer: jax.Array | None = None,  # [L, dp * (slots+1), k, W-1, 3, P]
    ):
        self.recurrent_buffer = recurrent_buffer
        self.conv_buffer = conv_buffer
        self.layer_ids = layer_ids
        if isinstance(allocators, SlotLayout):
            self.layout, self.allocators = allocators, None
        else:
            sizes = {allocator.num_slots for allocator in allocators}
            if len(allocators) < 1 or len(sizes) != 1:
                raise ValueError(f"a pool needs one allocator per data rank, all of one size; got {sizes}")
            self.layout, self.allocators = SlotLayout(sizes.pop(), len(allocators)), tuple(allocators)
        self.draft_recurrent_buffer = draft_recurrent_buffer
        self.draft_conv_buffer = draft_conv_buffer

    @classmethod
    def create(
        cls,
        config: KDAConfig,
        num_slots: int,
        dtype: Any = jnp.float32,
        layer_ids: Sequence[int] | None = None,
        mesh: Mesh | None = None,
    ) -> RecurrentStatePool:
        """Zeroed buffers for `num_slots` requests per data rank of the (0-based) KDA layers `layer_ids`.

        `layer_ids` defaults to the config's KDA layers. With a `mesh`, the buffers are created sharded
        (`RECURRENT_SPEC`, `CONV_SPEC`), one block of slots per data rank.
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
        dp, tp = (1, 1) if mesh is None else mesh_sizes(mesh)
        check_heads_divisible(config.num_heads, tp)
        num_layers, h, d = len(layer_ids), config.num_heads, config.head_dim
        rows = dp * (num_slots + 1)
        recurrent_shape = (num_layers, rows, h, d, d)
        conv_shape = (num_layers, rows, config.conv_size - 1, 3, config.proj_dim)

        shardings = None
        if mesh is not None:
            shardings = (NamedSharding(mesh, RECURRENT_SPEC), NamedSharding(mesh, CONV_SPEC))
        recurrent, conv = _zero_buffers(recurrent_shape, conv_shape, jnp.dtype(dtype), shardings)()
        allocators = tuple(SlotAllocator(num_slots) for _ in range(dp))
        return cls(recurrent, conv, layer_ids, allocators)

    def partition_specs(self) -> RecurrentStatePool:
        """This pool's tree with the `PartitionSpec` of each buffer (for `shard_map`)."""
        drafts = (DRAFT_RECURRENT_SPEC, DRAFT_CONV_SPEC) if self.draft_tokens else (None, None)
        return type(self)(RECURRENT_SPEC, CONV_SPEC, self.layer_ids, self.layout, *drafts)

    # --- pytree -------------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[tuple[int, ...], SlotLayout]]:
        children = (
            self.recurrent_buffer,
            self.conv_buffer,
            self.draft_recurrent_buffer,
            self.draft_conv_buffer,
        )
        return children, (self.layer_ids, self.layout)

    @classmethod
    def tree_unflatten(cls, aux: tuple[tuple[int, ...], SlotLayout], children: tuple) -> RecurrentStatePool:
        """The pool without allocators (`with_allocators_of` gives them back)."""
        recurrent, conv, *drafts = children
        return cls(recurrent, conv, *aux, *drafts)

    def with_allocators_of(self, source: RecurrentStatePool) -> RecurrentStatePool:
        """This pool's buffers with the allocators of `source`, the pool a jax transformation took in
        (none when `source` has none: inside another transformation); ValueError when their layers or
        slot layouts differ."""
        if (source.layer_ids, source.layout) != (self.layer_ids, self.layout):
            raise ValueError(
                f"with_allocators_of: the source pool (layers {source.layer_ids}, {source.layout}) cannot "
                f"give its allocators to a pool of layers {self.layer_ids}, {self.layout}"
            )
        return type(self)(
            self.recurrent_buffer, self.conv_buffer, self.layer_ids, source.allocators or source.layout,
            self.draft_recurrent_buffer, self.draft_conv_buffer,
        )  # fmt: skip

    _BUFFERS = ("recurrent_buffer", "conv_buffer", "draft_recurrent_buffer", "draft_conv_buffer")

    def replace(self, **buffers: jax.Array) -> RecurrentStatePool:
        """A pool of the same class sharing the layers and allocators, with the buffers named replaced
        (`recurrent_buffer`, `conv_buffer`, `draft_recurrent_buffer`, `draft_conv_buffer`)."""
        unknown = sorted(set(buffers) - set(self._BUFFERS))
        if unknown:
            raise TypeError(f"a pool has no buffer(s) {unknown}")
        recurrent, conv, *drafts = (buffers.get(name, getattr(self, name)) for name in self._BUFFERS)
        return type(self)(recurrent, conv, self.layer_ids, self.allocators or self.layout, *drafts)

    # --- speculative decoding: the draft buffers ------------------------------------------------------

    @property
    def draft_tokens(self) -> int:
        """Draft tokens per slot the draft buffers hold (0: none; `with_draft_tokens`)."""
        return 0 if self.draft_recurrent_buffer is None else int(self.draft_recurrent_buffer.shape[2])

    def with_draft_tokens(self, k: int) -> RecurrentStatePool:
        """This pool with zeroed draft buffers of `k` draft tokens per slot (outside `jit`; the states
        are kept), placed as the state buffers are."""
        if not is_int(k) or k < 1:
            raise ValueError(f"draft tokens k must be a positive int, got {k!r}")
        layers, rows = self.recurrent_buffer.shape[:2]
        shapes = (
            (layers, rows, k, *self.recurrent_buffer.shape[2:]),
            (layers, rows, k, *self.conv_buffer.shape[2:]),
        )
        dtypes = (self.recurrent_buffer.dtype, self.conv_buffer.dtype)
        specs = (DRAFT_RECURRENT_SPEC, DRAFT_CONV_SPEC)
        sharding = self.recurrent_buffer.sharding
        drafts = []
        for shape, dtype, spec in zip(shapes, dtypes, specs):
            buffer = jnp.zeros(shape, dtype)
            if isinstance(sharding, NamedSharding):
                buffer = jax.device_put(buffer, NamedSharding(sharding.mesh, spec))
            drafts.append(buffer)
        return self.replace(draft_recurrent_buffer=drafts[0], draft_conv_buffer=drafts[1])

    def accept_drafts(
        self, slots: Sequence[int] | np.ndarray, accepted: Sequence[int] | np.ndarray, dp_rank: int = 0
    ) -> RecurrentStatePool:
        """A pool whose `slots` `[N]` hold, in every layer, their states after the first `accepted[i]`
        draft tokens of their last verify forward (recurrent state and conv window); 0 keeps the state
        from before it. Outside `jit` (the buffers are donated); ValueError on a slot `rows` refuses or a
        count outside 0..draft_tokens."""
        if not self.draft_tokens:
            raise ValueError("the pool has no draft buffers: with_draft_tokens(k), then a verify forward")
        rows = self.rows(slots, dp_rank)
        counts = as_int_array(accepted, "accepted").reshape(-1)
        if counts.shape != rows.shape or np.any(counts < 0) or np.any(counts > self.draft_tokens):
            raise ValueError(
                f"accepted {counts.tolist()} must give each of the slots {np.asarray(slots).tolist()} a "
                f"count in 0..{self.draft_tokens} (the pool's draft tokens)"
            )
        self.allocator_check(slots, dp_rank)
        recurrent, conv = _accept_drafts(
            self.recurrent_buffer, self.conv_buffer, self.draft_recurrent_buffer, self.draft_conv_buffer,
            jnp.asarray(rows), jnp.asarray(counts, jnp.int32),
        )  # fmt: skip
        return self.replace(recurrent_buffer=recurrent, conv_buffer=conv)

    # --- whole-slot copies and loads (prefix caching, disaggregated serving) ----------------------------

    def copy_slots(
        self, src_slots: Sequence[int] | np.ndarray, dst_slots: Sequence[int] | np.ndarray, dp_rank: int = 0
    ) -> RecurrentStatePool:
        """A pool whose `dst_slots` `[N]` hold, in every layer, the recurrent and conv states of
        `src_slots` `[N]` (copy-on-write of a cached prefix). Outside `jit` (the buffers are donated);
        ValueError on a slot that is not allocated, repeated among the destinations, or a source that is
        also a destination."""
        src, dst = self.rows(src_slots, dp_rank), self.rows(dst_slots, dp_rank)
        if src.shape != dst.shape or set(src.tolist()) & set(dst.tolist()):
            raise ValueError(
                f"copy_slots needs as many sources as destinations and none of them both: got "
                f"{np.asarray(src_slots).tolist()} -> {np.asarray(dst_slots).tolist()}"
            )
        self.allocator_check(src_slots, dp_rank)
        self.allocator_check(dst_slots, dp_rank)
        recurrent, conv = _copy_slots(
            self.recurrent_buffer, self.conv_buffer, jnp.asarray(src), jnp.asarray(dst)
        )
        return self.replace(recurrent_buffer=recurrent, conv_buffer=conv)

    def load_slot(
        self,
        slot: int,
        recurrent: jax.Array | np.ndarray,  # [L, H, D, D]
        conv: jax.Array | np.ndarray,  # [L, W-1, 3, P]
        dp_rank: int = 0,
    ) -> RecurrentStatePool:
        """A pool whose `slot` holds the given states of every layer (the import of a disaggregated
        prefill's states). Outside `jit` (the buffers are donated); ValueError on a slot that is not
        allocated or states of another shape."""
        rows = self.rows([slot], dp_rank)
        self.allocator_check([slot], dp_rank)
        for name, value, buffer in (
            ("recurrent", recurrent, self.recurrent_buffer),
            ("conv", conv, self.conv_buffer),
        ):
            expected = (buffer.shape[0], *buffer.shape[2:])
            if tuple(np.shape(value)) != expected:
                raise ValueError(
                    f"load_slot: {name} must be {expected} (layers, then one slot's state), "
                    f"got {np.shape(value)}"
                )
        recurrent_buffer, conv_buffer = _load_slot(
            self.recurrent_buffer, self.conv_buffer, jnp.asarray(rows),
            jnp.asarray(recurrent, self.recurrent_buffer.dtype), jnp.asarray(conv, self.conv_buffer.dtype),
        )  # fmt: skip
        return self.replace(recurrent_buffer=recurrent_buffer, conv_buffer=conv_buffer)

    def allocator_check(self, slots: Sequence[int] | np.ndarray, dp_rank: int = 0) -> None:
        """ValueError naming the first of `slots` (of data rank `dp_rank`) that is not allocated."""
        allocator = self._allocator(dp_rank)
        for slot in as_int_array(slots, "slots").reshape(-1).tolist():
            if not allocator.is_allocated(slot):
                raise ValueError(f"slot {slot} is not allocated; allocate it with RecurrentStatePool.alloc")

    # --- host-side slot bookkeeping -----------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Real slots per data rank (1..num_slots); each rank's block has one more row, its dummy slot 0."""
        return self.layout.num_slots

    @property
    def dp_size(self) -> int:
        """Data ranks: blocks of `num_slots + 1` rows along the slot axis."""
        return self.layout.dp_size

    def alloc(self, n: int, dp_rank: int = 0) -> np.ndarray:
        """Reserve `n` free slots of data rank `dp_rank`, zero their states in every layer, and return
        them as i32[n] (slot numbers local to the rank)."""
        slots = self._allocator(dp_rank).alloc(n)
        if n:
            # Pad the rows to a power of two with the rank's dummy slot: one compilation per size class.
            padded = np.full(1 << (n - 1).bit_length(), self.rows_per_rank * dp_rank + DUMMY_SLOT, np.int32)
            padded[:n] = self.rows(slots, dp_rank)
            self.recurrent_buffer, self.conv_buffer = _zero_slots(
                self.recurrent_buffer, self.conv_buffer, padded
            )
        return slots

    def free(self, slots: Sequence[int] | np.ndarray, dp_rank: int = 0) -> None:
        """Return `slots` of data rank `dp_rank` to its free list (ValueError on a non-integer,
        out-of-range, unallocated or repeated slot)."""
        self._allocator(dp_rank).free(slots)

    def get_recurrent_indices(
        self, req_pool_indices: Sequence[int] | np.ndarray, dp_rank: int = 0
    ) -> np.ndarray:
        """The pool slots `i32[N]` of the requests holding slots `req_pool_indices` (slot = request index)
        of data rank `dp_rank`.

        ValueError naming the slot and the pool size when one is not an int, out of range, the dummy,
        repeated or not allocated.
        """
        slots = as_int_array(req_pool_indices, "req_pool_indices")
        if slots.ndim != 1:
            raise ValueError(f"req_pool_indices must be a 1-D list of integers, got {slots.tolist()}")
        check_request_slots(slots, self.num_slots)
        self.allocator_check(slots, dp_rank)
        return slots.astype(np.int32)

    @property
    def rows_per_rank(self) -> int:
        """Rows of one data rank's block: its dummy slot 0 and its real slots 1..num_slots."""
        return self.num_slots + 1

    def rows(self, slots: Sequence[int] | np.ndarray, dp_rank: int = 0) -> np.ndarray:
        """i32 rows of the whole buffers holding the real `slots` of data rank `dp_rank` (for host-side
        access); ValueError on a non-integer, out-of-range, dummy or repeated slot."""
        self._check_rank(dp_rank)
        slots = as_int_array(slots, "slots").reshape(-1)
        check_request_slots(slots, self.num_slots)
        return (dp_rank * self.rows_per_rank + slots).astype(np.int32)

    def _check_rank(self, dp_rank: int) -> None:
        if not is_int(dp_rank):
            raise ValueError(f"dp_rank must be an int, got {dp_rank!r}")
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not a data rank of this pool (it has {self.dp_size})")

    def _allocator(self, dp_rank: int) -> SlotAllocator:
        self._check_rank(dp_rank)
        if self.allocators is None:
            raise ValueError(
                "this pool came out of a jax transformation, which carries its buffers and not its slot "
                "allocators: give it those of the pool that went in, pool.with_allocators_of(that_pool)"
            )
        return self.allocators[dp_rank]

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
        """`(recurrent [rows, H, D, D] fp32, conv [rows, W-1, 3, P])` of one layer."""
        i = self.layer_index(layer_id)
        return self.recurrent_buffer[i], self.conv_buffer[i]

    def get_slot_states(
        self,
        layer_id: int,
        slot_indices: jax.Array | np.ndarray | Sequence[int],  # int[N] rows of the buffers
        *,
        padding_rows: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        """`(recurrent [N, H, D, D] fp32, conv [N, W-1, 3, P])` of `slot_indices` of layer `layer_id`.

        The rows are checked or routed as `safe_rows` says: an unsafe index reads the dummy slot.
        """
        i = self.layer_index(layer_id)
        rows = self.safe_rows(slot_indices, padding_rows=padding_rows)
        return self.recurrent_buffer[i, rows], self.conv_buffer[i, rows]

    def set_linear_recurrent_layer_cache(
        self,
        layer_id: int,
        slot_indices: jax.Array | np.ndarray | Sequence[int],  # int[N] rows of the buffers
        new_recurrent: jax.Array,  # [N, H, D, D]
        new_conv: jax.Array,  # [N, W-1, 3, P]
        *,
        padding_rows: bool = False,
    ) -> RecurrentStatePool:
        """A pool whose `slot_indices` of layer `layer_id` hold the new states (the rest unchanged).

        The rows are checked or routed as `safe_rows` says: an unsafe index writes the dummy slot only.
        Under `jit` with the pool donated, XLA updates the buffers in place.
        """
        i = self.layer_index(layer_id)
        rows = self.safe_rows(slot_indices, padding_rows=padding_rows)
        _check_new_states("new_recurrent", "[N={n}, H, D, D]", new_recurrent, self.recurrent_buffer, rows)
        _check_new_states("new_conv", "[N={n}, W-1, 3, P]", new_conv, self.conv_buffer, rows)
        recurrent = self.recurrent_buffer.at[i, rows].set(new_recurrent.astype(self.recurrent_buffer.dtype))
        conv = self.conv_buffer.at[i, rows].set(new_conv.astype(self.conv_buffer.dtype))
        return self.replace(recurrent_buffer=recurrent, conv_buffer=conv)

    def set_conv_states(
        self,
        layer_id: int,
        slot_indices: jax.Array | np.ndarray | Sequence[int],  # int[N] rows of the buffers
        new_conv: jax.Array,  # [N, W-1, 3, P]
        *,
        padding_rows: bool = False,
    ) -> RecurrentStatePool:
        """A pool whose `slot_indices` of layer `layer_id` hold the new conv states (checked or routed as
        `safe_rows` says)."""
        i = self.layer_index(layer_id)
        rows = self.safe_rows(slot_indices, padding_rows=padding_rows)
        _check_new_states("new_conv", "[N={n}, W-1, 3, P]", new_conv, self.conv_buffer, rows)
        conv = self.conv_buffer.at[i, rows].set(new_conv.astype(self.conv_buffer.dtype))
        return self.replace(conv_buffer=conv)

    def set_draft_states(
        self,
        layer_id: int,
        slot_indices: jax.Array | np.ndarray | Sequence[int],  # int[N] rows of the buffers
        recurrent: jax.Array,  # [N, k, H, D, D]
        conv: jax.Array,  # [N, k, W-1, 3, P]
        *,
        padding_rows: bool = False,
    ) -> RecurrentStatePool:
        """A pool whose draft buffers hold, for `slot_indices` of layer `layer_id`, the states after each
        of a verify forward's k draft tokens (checked or routed as `safe_rows` says)."""
        i = self.layer_index(layer_id)
        rows = self.safe_rows(slot_indices, padding_rows=padding_rows)
        if self.draft_recurrent_buffer is None or self.draft_conv_buffer is None:
            raise ValueError("the pool has no draft buffers: with_draft_tokens(k) first")
        for name, new, buffer in (("recurrent", recurrent, self.draft_recurrent_buffer),
                                  ("conv", conv, self.draft_conv_buffer)):  # fmt: skip
            _check_new_states(f"draft {name}", "[N={n}, k, ...]", new, buffer, rows)
        return self.replace(
            draft_recurrent_buffer=self.draft_recurrent_buffer.at[i, rows].set(
                recurrent.astype(self.draft_recurrent_buffer.dtype)
            ),
            draft_conv_buffer=self.draft_conv_buffer.at[i, rows].set(
                conv.astype(self.draft_conv_buffer.dtype)
            ),
        )

    def safe_rows(
        self, slot_indices: jax.Array | np.ndarray | Sequence[int], *, padding_rows: bool = False
    ) -> jax.Array:
        """i32[N]: `slot_indices`, rows of the buffers as the caller sees them, made safe to index with.

        Concrete indices (outside `jit`) are checked: ValueError naming the row and the pool size on a
        non-integer, out-of-range, dummy (of any data rank) or repeated row; with `padding_rows`, rows on
        a dummy slot are padding rows and allowed, any number of times. Traced indices (inside `jit`)
        cannot be checked: every out-of-range or repeated non-dummy row is routed to the dummy slot 0, so
        that it reads and writes no real request's state.
        """
        check_integer_indices(slot_indices)
        num_rows = self.recurrent_buffer.shape[1]
        if not isinstance(slot_indices, jax.core.Tracer):
            self._check_rows(as_int_array(slot_indices, "slot_indices"), num_rows, padding_rows)
        return route_unsafe_slots_to_dummy(slot_indices, num_rows, block=self.rows_per_rank)

    def _check_rows(self, rows: np.ndarray, num_rows: int, padding_rows: bool) -> None:
        if rows.ndim != 1:
            raise ValueError(f"slot_indices must be a 1-D list of buffer rows, got shape {rows.shape}")
        block, num_slots = self.rows_per_rank, self.num_slots
        for row in rows.tolist():
            if not 0 <= row < num_rows:
                raise ValueError(
                    f"row {row} is outside the pool's {num_rows} rows ({num_rows // block} data rank(s), "
                    f"each with its dummy slot 0 and real slots 1..{num_slots} of a {num_slots}-slot pool)"
                )
            rank, slot = divmod(row, block)
            if slot == DUMMY_SLOT and not padding_rows:
                raise ValueError(
                    f"row {row} is data rank {rank}'s dummy slot 0, no request's: real slots are "
                    f"1..{num_slots} of each rank's {num_slots}-slot pool"
                )
        repeated = first_repeat(rows[rows % block != DUMMY_SLOT])
        if repeated is not None:
            raise ValueError(
                f"row {repeated} is given to two requests of one batch: each request needs its own slot "
                f"of the {num_slots}-slot pool"
            )


def _check_new_states(name: str, layout: str, new: jax.Array, buffer: jax.Array, rows: jax.Array) -> None:
    """ValueError unless `new` holds one state of `buffer`'s shape per row."""
    n = rows.shape[0]
    expected = (n, *buffer.shape[2:])
    if new.shape != expected:
        raise ValueError(f"{name} must be {layout.format(n=n)}={expected}, got {new.shape}")


@functools.cache
def _zero_buffers(
    recurrent_shape: tuple[int, ...],
    conv_shape: tuple[int, ...],
    dtype: np.dtype,
    shardings: tuple[NamedSharding, NamedSharding] | None,
) -> Any:
    """A function making a pool's zeroed buffers (fp32 recurrent, `dtype` conv), created in place with
    `shardings`; one per pool shape, so that a new pool of a known shape compiles nothing."""

    def zeros() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros(recurrent_shape, jnp.float32), jnp.zeros(conv_shape, dtype)

    return zeros if shardings is None else jax.jit(zeros, out_shardings=shardings)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _zero_slots(
    recurrent: jax.Array,  # [L, rows, H, D, D]
    conv: jax.Array,  # [L, rows, W-1, 3, P]
    rows: jax.Array,  # i32[n]
) -> tuple[jax.Array, jax.Array]:
    return recurrent.at[:, rows].set(0), conv.at[:, rows].set(0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _copy_slots(
    recurrent: jax.Array,  # [L, rows, H, D, D]
    conv: jax.Array,  # [L, rows, W-1, 3, P]
    src: jax.Array,  # i32[n]
    dst: jax.Array,  # i32[n]
) -> tuple[jax.Array, jax.Array]:
    return recurrent.at[:, dst].set(recurrent[:, src]), conv.at[:, dst].set(conv[:, src])


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _load_slot(
    recurrent: jax.Array,  # [L, rows, H, D, D]
    conv: jax.Array,  # [L, rows, W-1, 3, P]
    rows: jax.Array,  # i32[1]
    new_recurrent: jax.Array,  # [L, H, D, D]
    new_conv: jax.Array,  # [L, W-1, 3, P]
) -> tuple[jax.Array, jax.Array]:
    return recurrent.at[:, rows].set(new_recurrent[:, None]), conv.at[:, rows].set(new_conv[:, None])


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _accept_drafts(
    recurrent: jax.Array,  # [L, rows, H, D, D]
    conv: jax.Array,  # [L, rows, W-1, 3, P]
    draft_recurrent: jax.Array,  # [L, rows, k, H, D, D]
    draft_conv: jax.Array,  # [L, rows, k, W-1, 3, P]
    rows: jax.Array,  # i32[n]
    accepted: jax.Array,  # i32[n] in 0..k
) -> tuple[jax.Array, jax.Array]:
    step = jnp.maximum(accepted - 1, 0)
    keep = (accepted > 0)[None, :, None, None, None]
    new_recurrent = jnp.where(keep, draft_recurrent[:, rows, step], recurrent[:, rows])
    new_conv = jnp.where(keep, draft_conv[:, rows, step], conv[:, rows])
    return recurrent.at[:, rows].set(new_recurrent), conv.at[:, rows].set(new_conv)
