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
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_impl.kernels.common import KdaInputs
from kda_impl.kernels.decode import FLA_DECODE_ARGUMENTS, prepare_decode
from kda_impl.kernels.pallas.common import column_step, pack_columns, pack_rows, resolve_interpret, row_step
from kda_impl.kernels.pallas.tuning import decode_heads_per_step


def decode_kda_slots(
    q: jax.Array,  # [B, H, K]
    k: jax.Array,  # [B, H, K]
    v: jax.Array,  # [B, HV, V]
    g: jax.Array,  # [B, HV, K]
    beta: jax.Array,  # [B, HV]
    *,
    state_buffer: jax.Array,  # [S, HV, K, V] one layer of the pool, or [L, S, HV, K, V] with layer_index
    slot_indices: jax.Array,  # int[B]: distinct real slots 1..S-1, padding rows 0
    layer_index: int | jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,  # fla's name
    dt_bias: jax.Array | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per request on its own slot's state, updated in place.

    Returns `(o [B, HV, V] in q's dtype, state_buffer with the given slots updated)`. Slot indices are
    checked (outside `jit`) or routed to the dummy slot (inside it) as in `decode.decode_kda_slots`; fla's
    options as there (with `state_v_first` the pool's states are `[..., V, K]`, stepped in that layout).
    """
    arguments = locals()
    fla = {name: arguments[name] for name in FLA_DECODE_ARGUMENTS}
    pool, layer, slots, inputs, options = prepare_decode(
        KdaInputs(q, k, v, g, beta), state_buffer, slot_indices, layer_index, **fla
    )
    _, heads, key_dim = inputs.q.shape
    v_first = options.state_v_first
    pack = pack_rows if v_first else pack_columns
    o, pool = _decode(
        slots,
        layer.reshape(1),
        pack(inputs.q, inputs.k, inputs.g, inputs.beta),
        inputs.v[:, :, :, None] if v_first else inputs.v[:, :, None, :],
        pool,
        heads_per_step=decode_heads_per_step(heads, key_dim, inputs.v.shape[-1]),
        state_v_first=v_first,
        interpret=resolve_interpret(interpret),
    )
    o = o[:, :, :, 0] if v_first else o[:, :, 0]
    return o.astype(q.dtype), (pool[0] if layer_index is None else pool)


@functools.partial(jax.jit, static_argnames=("heads_per_step", "state_v_first", "interpret"))
def _decode(
    slot_indices: jax.Array,  # i32[B], routed: each in 0..S-1, real ones distinct
    layer_index: jax.Array,  # i32[1]
    packed: jax.Array,  # [B, H, K, 4] q (scaled), k, g, beta columns; [B, H, 4, K] rows if v-first
    v: jax.Array,  # [B, H, 1, V]; [B, H, V, 1] if v-first
    pool: jax.Array,  # [L, S, H, K, V]; [L, S, H, V, K] if v-first
    *,
    heads_per_step: int,
    state_v_first: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    batch, heads = packed.shape[:2]
    hb = heads_per_step
    row_block = pl.BlockSpec((None, hb, *v.shape[2:]), lambda b, h, slots, layer: (b, h, 0, 0))
    state_block = pl.BlockSpec(
        (None, None, hb, *pool.shape[3:]), lambda b, h, slots, layer: (layer[0], slots[b], h, 0, 0)
    )
    return pl.pallas_call(
        functools.partial(_decode_kernel, step=row_step if state_v_first else column_step),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads // hb),
            in_specs=[
                pl.BlockSpec((None, hb, *packed.shape[2:]), lambda b, h, slots, layer: (b, h, 0, 0)),
                row_block,
                state_block,
            ],
            out_specs=[row_block, state_block],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ],
        input_output_aliases={4: 1},  # the pool (after the two prefetched index arrays) → the new pool
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(slot_indices, layer_index, packed, v, pool)


def _decode_kernel(
    # scalar prefetch
    slots_ref: jax.Array,  # i32[B] (used by the index maps)
    layer_ref: jax.Array,  # i32[1] (used by the index maps)
    # inputs (v-first: packed [hb, 4, K], v [hb, V, 1], states [hb, V, K])
    packed_ref: jax.Array,  # [hb, K, 4]
    v_ref: jax.Array,  # [hb, 1, V]
    state_ref: jax.Array,  # [hb, K, V] the request's slot
    # outputs
    o_ref: jax.Array,  # [hb, 1, V] (v-first: [hb, V, 1])
    new_state_ref: jax.Array,  # [hb, K, V] the same slot, aliased
    *,
    step: Callable,  # column_step, or row_step for v-first states
) -> None:
    state, o = step(state_ref[...].astype(jnp.float32), packed_ref[...], v_ref[...])
    new_state_ref[...] = state.astype(new_state_ref.dtype)
    o_ref[...] = o
