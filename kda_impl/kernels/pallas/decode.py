"""Decode as a Pallas kernel: one token for each of B requests, each on its own pool slot, in place.

Reference: `kda_impl.kernels.decode.decode_kda_slots` (gather, step, scatter).

Grid `(B, H / hb)`, hb heads per step (`tuning.decode_heads_per_step`). The slot indices and the
layer index are scalar prefetched, so the index map of the state block reads `[layer, slot_indices[b]]`:
each step DMAs exactly its request's `[hb, K, V]` states in and the updated ones out. The pool buffer
is aliased input → output (`input_output_aliases`), so the slots of other requests are never read or
written and, with the buffer donated by the caller's jit, decode neither gathers nor scatters the pool.

Slot contract (as the plain-JAX decode's): real rows use distinct slots 1..S-1, padding rows the dummy
slot 0 (their steps race on it: what it holds afterwards is unspecified). The indices are routed before
they are prefetched: inside `jit` an out-of-range or repeated non-dummy index becomes the dummy slot, so
no DMA ever reads or writes a real slot through it (nor outside the buffer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_impl.kernels.common import KdaInputs
from kda_impl.kernels.decode import prepare_decode
from kda_impl.kernels.pallas.common import COLUMNS, column_step, pack_columns, resolve_interpret
from kda_impl.kernels.pallas.tuning import decode_heads_per_step


def decode_kda_slots(
    q: jax.Array,  # [B, H, K]
    k: jax.Array,  # [B, H, K]
    v: jax.Array,  # [B, H, V]
    g: jax.Array,  # [B, H, K]
    beta: jax.Array,  # [B, H]
    *,
    state_buffer: jax.Array,  # [S, H, K, V] one layer of the pool, or [L, S, H, K, V] with layer_index
    slot_indices: jax.Array,  # int[B]: distinct real slots 1..S-1, padding rows 0
    layer_index: int | jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per request on its own slot's state, updated in place.

    Returns `(o [B, H, V] in q's dtype, state_buffer with the given slots updated)`. Slot indices are
    checked (outside `jit`) or routed to the dummy slot (inside it) as in `decode.decode_kda_slots`.
    """
    pool, layer, slots, inputs = prepare_decode(
        KdaInputs(q, k, v, g, beta), state_buffer, slot_indices, layer_index, scale, use_qk_l2norm_in_kernel
    )
    _, heads, key_dim = inputs.q.shape
    o, pool = _decode(
        slots,
        layer.reshape(1),
        pack_columns(inputs.q, inputs.k, inputs.g, inputs.beta),
        inputs.v[:, :, None, :],
        pool,
        heads_per_step=decode_heads_per_step(heads, key_dim, inputs.v.shape[-1]),
        interpret=resolve_interpret(interpret),
    )
    return o[:, :, 0].astype(q.dtype), (pool[0] if layer_index is None else pool)


@functools.partial(jax.jit, static_argnames=("heads_per_step", "interpret"))
def _decode(
    slot_indices: jax.Array,  # i32[B], routed: each in 0..S-1, real ones distinct
    layer_index: jax.Array,  # i32[1]
    columns: jax.Array,  # [B, H, K, 4] q (scaled), k, g, beta
    v: jax.Array,  # [B, H, 1, V]
    pool: jax.Array,  # [L, S, H, K, V]
    *,
    heads_per_step: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    batch, heads, key_dim, _ = columns.shape
    value_dim = v.shape[-1]
    hb = heads_per_step
    row_block = pl.BlockSpec((None, hb, 1, value_dim), lambda b, h, slots, layer: (b, h, 0, 0))
    state_block = pl.BlockSpec(
        (None, None, hb, key_dim, value_dim), lambda b, h, slots, layer: (layer[0], slots[b], h, 0, 0)
    )
    return pl.pallas_call(
        _decode_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads // hb),
            in_specs=[
                pl.BlockSpec((None, hb, key_dim, COLUMNS), lambda b, h, slots, layer: (b, h, 0, 0)),
                row_block,
                state_block,
            ],
            out_specs=[row_block, state_block],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads, 1, value_dim), jnp.float32),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ],
        input_output_aliases={4: 1},  # the pool (after the two prefetched index arrays) → the new pool
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(slot_indices, layer_index, columns, v, pool)


def _decode_kernel(
    # scalar prefetch
    slots_ref: jax.Array,  # i32[B] (used by the index maps)
    layer_ref: jax.Array,  # i32[1] (used by the index maps)
    # inputs
    columns_ref: jax.Array,  # [hb, K, 4]
    v_ref: jax.Array,  # [hb, 1, V]
    state_ref: jax.Array,  # [hb, K, V] the request's slot
    # outputs
    o_ref: jax.Array,  # [hb, 1, V]
    new_state_ref: jax.Array,  # [hb, K, V] the same slot, aliased
) -> None:
    state, o = column_step(state_ref[...].astype(jnp.float32), columns_ref[...], v_ref[...])
    new_state_ref[...] = state.astype(new_state_ref.dtype)
    o_ref[...] = o
