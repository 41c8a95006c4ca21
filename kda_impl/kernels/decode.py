"""Decode in plain JAX: one token for each of B requests, states read from and written to pool slots.

Slot contract (`kda_impl.kernels.slots`, shared with the Pallas decode): slot 0 of the state buffer is the
dummy slot of padding rows, which may repeat it; every other row is a real request on its own slot
1..S-1. Outside `jit` any other index is refused (ValueError naming it and the buffer size); inside `jit`
an out-of-range or repeated non-dummy index is routed to the dummy slot, so it never aliases a real slot.

Layout of the work: one `fori_loop` over the B rows and their blocks of heads, each reading its slot's
`[hb, K, V]` states with a dynamic slice, stepping them and writing them back with a dynamic update
slice into the loop-carried buffer. XLA updates a loop-carried buffer in place, so a donated state
buffer is never copied, and no `[B, H, K, V]` gather or scatter temporary exists: only one block of
states (256 KiB at most) is live at a time, and it stays in cache between its read and its write.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kda_impl.kernels.common import KdaInputs, prepare_inputs
from kda_impl.kernels.options import FlaOptions, apply_options, fla_options, swap_state_layout
from kda_impl.kernels.slots import (
    as_int_array,
    check_integer_indices,
    check_request_slots,
    route_unsafe_slots_to_dummy,
)
from kda_impl.kernels.validation import validate_float_inputs


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
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per request on its own slot's state.

    fla's options (`kda_impl.kernels.options`) as the prefill kernels take them; with `state_v_first`
    the pool's states are `[..., V, K]`.

    With `layer_index`, `state_buffer` is the whole pool and only `[layer_index, slot_indices]` is
    read and written. Steps the B slots one after another in place (see `step_slots_in_place`); the
    other slots are untouched. Returns `(o [B, H, V] in q's dtype, the updated state_buffer)`.

    Slot 0 is the dummy slot: padding rows may all use it (what it holds afterwards is unspecified).
    Concrete `slot_indices` outside 0..S-1 or repeating a real slot are refused; traced ones (under
    `jit`) are routed instead: such a row reads and writes the dummy slot, never a real one.
    """
    arguments = locals()
    fla = {name: arguments[name] for name in FLA_DECODE_ARGUMENTS}
    inputs = KdaInputs(q, k, v, g, beta)
    *call, options = prepare_decode(inputs, state_buffer, slot_indices, layer_index, **fla)
    o, pool = step_slots_in_place(*call, state_v_first=options.state_v_first)
    return o.astype(q.dtype), (pool[0] if layer_index is None else pool)


# The keyword arguments of `decode_kda_slots` that `prepare_decode` takes (scale and fla's options).
FLA_DECODE_ARGUMENTS = (
    "scale",
    "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel",
    "A_log",
    "dt_bias",
    "safe_gate",
    "lower_bound",
    "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval",
    "state_v_first",
)


def prepare_decode(
    inputs: KdaInputs,  # [B, H(V), ...] as the caller gives them
    state_buffer: jax.Array,  # [S, HV, K, V], or [L, S, HV, K, V] with layer_index ([..., V, K] v-first)
    slot_indices: jax.Array,  # int[B]
    layer_index: int | jax.Array | None,
    scale: float | None = None,
    **fla: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, KdaInputs, FlaOptions]:
    """A decode call (plain JAX or Pallas) checked and made ready for its step, as the arguments of
    `step_slots_in_place` and the call's options: `(pool [L, S, HV, K, V] (or [..., V, K]), layer i32[],
    slots i32[B] routed to the dummy slot where unsafe, inputs fp32 on the HV heads with q scaled, q and k
    l2-normalised if asked, beta activated and g the log decay, options)`; `fla` fla's options
    (`options.fla_options`)."""
    options, gate = fla_options(g_shape=np.shape(inputs.g), **fla)
    pool = as_layered_pool(state_buffer, layer_index)
    layer = 0 if layer_index is None else layer_index
    validate_decode_inputs(inputs, pool, slot_indices, layer, options.state_v_first)
    slots = route_unsafe_slots_to_dummy(slot_indices, pool.shape[1])
    *prepared, scale = prepare_inputs(*inputs, scale, options.use_qk_l2norm_in_kernel)
    prepared = apply_options(KdaInputs(*prepared), gate, options).scaled(scale)
    return pool, jnp.asarray(layer, jnp.int32), slots, prepared, options


STATE_BLOCK_BYTES = 256 * 1024  # the states one loop step reads and writes back: they stay in L2 meanwhile


def heads_per_step(heads: int, key_dim: int, value_dim: int) -> int:
    """The most heads (a divisor of H, at least 1) whose fp32 states fit in `STATE_BLOCK_BYTES`."""
    head_bytes = key_dim * value_dim * 4
    fitting = [hb for hb in range(1, heads + 1) if heads % hb == 0 and hb * head_bytes <= STATE_BLOCK_BYTES]
    return max(fitting, default=1)


def step_slots_in_place(
    pool: jax.Array,  # [L, S, H, K, V], or [L, S, H, V, K] with state_v_first
    layer: jax.Array,  # i32[] the layer of the pool to step
    slots: jax.Array,  # i32[B] routed: each in 0..S-1, real ones distinct
    inputs: KdaInputs,  # [B, H, ...] fp32, q already scaled
    *,
    state_v_first: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step of each row on `pool[layer, slots[row]]`; returns (o [B, H, V] fp32, pool).
    A v-first block is transposed to `[hb, K, V]` after its read and back before its write.

    The step of `recurrent_step` (`S = S exp(g)`, `S += beta k (v - k S)^T`, `o = q S`), rewritten to
    read the old state S once for both products: with `d = exp(g)`,

        k (S d) = (k d) S,    q S_new = (q d) S + (q . k) delta,    delta = beta (v - (k d) S),

    so a block of hb heads (`heads_per_step`) is read by one `[hb, 2, K] x [hb, K, V]` product, then
    rewritten once as `S d + k delta^T` while still in cache. The loop visits (row, head block) in order,
    so padding rows sharing the dummy slot step it one after another.
    """
    q, k, v, g, beta = inputs
    batch, heads, key_dim = q.shape
    hb = heads_per_step(heads, key_dim, v.shape[-1])
    blocks = heads // hb

    def by_block(x: jax.Array) -> jax.Array:  # [B, H, ...] -> [B * blocks, hb, ...]
        return x.reshape(batch * blocks, hb, *x.shape[2:])

    decay = jnp.exp(g)
    readers = by_block(jnp.stack([q * decay, k * decay], axis=2))  # [., hb, 2, K]: the reads of old S
    q_dot_k, k, v, decay, beta = map(by_block, (jnp.sum(q * k, axis=-1), k, v, decay, beta))
    block_shape = (1, 1, hb, *pool.shape[3:])

    def step_block(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        pool, o = carry
        start = (layer, slots[i // blocks], (i % blocks) * hb, 0, 0)
        state = lax.dynamic_slice(pool, start, block_shape)[0, 0].astype(jnp.float32)
        state = swap_state_layout(state) if state_v_first else state  # [hb, K, V]
        read = jnp.sum(readers[i][:, :, :, None] * state[:, None], axis=2)  # [hb, 2, V]
        delta = beta[i][:, None] * (v[i] - read[:, 1])  # [hb, V]
        o = lax.dynamic_update_index_in_dim(o, read[:, 0] + q_dot_k[i][:, None] * delta, i, 0)
        state = state * decay[i][:, :, None] + k[i][:, :, None] * delta[:, None, :]
        state = swap_state_layout(state) if state_v_first else state
        pool = lax.dynamic_update_slice(pool, state.astype(pool.dtype)[None, None], start)
        return pool, o

    pool, o = lax.fori_loop(0, batch * blocks, step_block, (pool, jnp.zeros(v.shape, jnp.float32)))
    return o.reshape(batch, heads, -1), pool


def as_layered_pool(state_buffer: jax.Array, layer_index: int | jax.Array | None) -> jax.Array:
    """The state buffer as [L, S, H, K, V]: a one-layer buffer [S, H, K, V] gets L = 1."""
    state_buffer = jnp.asarray(state_buffer)
    expected_rank = 4 if layer_index is None else 5
    if state_buffer.ndim != expected_rank:
        layout = "[S, H, K, V]" if layer_index is None else "[L, S, H, K, V] (layer_index given)"
        raise ValueError(f"state_buffer must be {layout}, got shape {state_buffer.shape}")
    return state_buffer[None] if layer_index is None else state_buffer


def validate_decode_inputs(
    inputs: KdaInputs,  # q, k [B, H, K]; v [B, HV, V]; g [B, HV, K]; beta [B, HV]
    pool: jax.Array,  # [L, S, HV, K, V], or [L, S, HV, V, K] with state_v_first
    slot_indices: jax.Array,  # int[B]
    layer_index: int | jax.Array,
    state_v_first: bool = False,
) -> None:
    """Shape and dtype checks of a decode call, naming the offending argument (works while tracing);
    outside `jit`, the slot contract of this module's docstring too."""
    validate_float_inputs(**inputs._asdict(), pool=pool)
    q, k, v, g, beta = inputs
    if q.ndim != 3:
        raise ValueError(f"decode q must be [B, H, K] (one token per request), got shape {q.shape}")
    batch, heads, key_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"decode k.shape={k.shape} must equal q.shape={q.shape}")
    if v.ndim != 3 or v.shape[0] != batch or v.shape[1] % heads:
        raise ValueError(
            f"decode v must be [B, HV, V] with B={batch} and HV a multiple of H={heads}, got {v.shape}"
        )
    value_heads, value_dim = v.shape[1:]
    if g.shape != (batch, value_heads, key_dim):
        raise ValueError(f"decode g.shape={g.shape} must be [B, HV, K]={(batch, value_heads, key_dim)}")
    if beta.shape != (batch, value_heads):
        raise ValueError(f"decode beta.shape={beta.shape} must be [B, HV]={(batch, value_heads)}")
    layout = "[HV, V, K]" if state_v_first else "[HV, K, V]"
    expected_state = (value_heads, *((value_dim, key_dim) if state_v_first else (key_dim, value_dim)))
    if pool.shape[2:] != expected_state:
        raise ValueError(f"state_buffer states must be {layout}={expected_state}, got {pool.shape[2:]}")
    if np.shape(slot_indices) != (batch,):
        raise ValueError(f"slot_indices.shape={np.shape(slot_indices)} must be [B]=({batch},)")
    check_integer_indices(slot_indices)
    layers, slots = pool.shape[:2]
    if not isinstance(layer_index, jax.core.Tracer) and not 0 <= int(layer_index) < layers:
        raise ValueError(f"layer_index={int(layer_index)} is outside the pool's {layers} layers")
    if not isinstance(slot_indices, jax.core.Tracer):
        indices = as_int_array(slot_indices, "slot_indices")
        bad = (indices < 0) | (indices >= slots)
        if np.any(bad):
            raise ValueError(
                f"slot index {int(indices[np.argmax(bad)])} is outside the state buffer's {slots} slots "
                f"0..{slots - 1} (slot 0 is the dummy of padding rows)"
            )
        check_request_slots(indices, slots - 1, padding_rows=True)
