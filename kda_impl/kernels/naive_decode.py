"""Decode in plain JAX: one token for each of B requests, states read from and written to pool slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.common import prepare_inputs
from kda_impl.kernels.naive_recurrent import recurrent_step


def decode_kda_slots(
    q: jax.Array,  # [B, H, K]
    k: jax.Array,  # [B, H, K]
    v: jax.Array,  # [B, H, V]
    g: jax.Array,  # [B, H, K]
    beta: jax.Array,  # [B, H]
    *,
    state_buffer: jax.Array,  # [S, H, K, V] one layer of the pool, or [L, S, H, K, V] with layer_index
    slot_indices: jax.Array,  # i32[B]
    layer_index: int | jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per request on its own slot's state.

    With `layer_index`, `state_buffer` is the whole pool and only `[layer_index, slot_indices]` is
    read and written. Gathers the B states, steps them and scatters them back; the other slots are
    untouched. Returns `(o [B, H, V] in q's dtype, the updated state_buffer)`.
    """
    pool = as_layered_pool(state_buffer, layer_index)
    layer = 0 if layer_index is None else layer_index
    validate_decode_inputs(q, k, v, g, beta, pool, slot_indices, layer)
    out_dtype = q.dtype
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    states = pool[layer, slot_indices].astype(jnp.float32)
    states, o = recurrent_step(states, q * scale, k, v, g, beta)
    pool = pool.at[layer, slot_indices].set(states.astype(pool.dtype))
    return o.astype(out_dtype), (pool[0] if layer_index is None else pool)


def as_layered_pool(state_buffer: jax.Array, layer_index: int | jax.Array | None) -> jax.Array:
    """The state buffer as [L, S, H, K, V]: a one-layer buffer [S, H, K, V] gets L = 1."""
    state_buffer = jnp.asarray(state_buffer)
    expected_rank = 4 if layer_index is None else 5
    if state_buffer.ndim != expected_rank:
        layout = "[S, H, K, V]" if layer_index is None else "[L, S, H, K, V] (layer_index given)"
        raise ValueError(f"state_buffer must be {layout}, got shape {state_buffer.shape}")
    return state_buffer[None] if layer_index is None else state_buffer


def validate_decode_inputs(
    q: jax.Array,  # [B, H, K]
    k: jax.Array,  # [B, H, K]
    v: jax.Array,  # [B, H, V]
    g: jax.Array,  # [B, H, K]
    beta: jax.Array,  # [B, H]
    pool: jax.Array,  # [L, S, H, K, V]
    slot_indices: jax.Array,  # i32[B]
    layer_index: int | jax.Array,
) -> None:
    """Shape checks of a decode call, naming the offending argument (works while tracing)."""
    if q.ndim != 3:
        raise ValueError(f"decode q must be [B, H, K] (one token per request), got shape {q.shape}")
    batch, heads, key_dim = q.shape
    for name, array in (("k", k), ("g", g)):
        if array.shape != q.shape:
            raise ValueError(f"decode {name}.shape={array.shape} must equal q.shape={q.shape}")
    if v.ndim != 3 or v.shape[:2] != (batch, heads):
        raise ValueError(f"decode v must be [B, H, V] with B, H = {(batch, heads)}, got {v.shape}")
    if beta.shape != (batch, heads):
        raise ValueError(f"decode beta.shape={beta.shape} must be [B, H]={(batch, heads)}")
    expected_state = (heads, key_dim, v.shape[2])
    if pool.shape[2:] != expected_state:
        raise ValueError(f"state_buffer states must be [H, K, V]={expected_state}, got {pool.shape[2:]}")
    if jnp.shape(slot_indices) != (batch,):
        raise ValueError(f"slot_indices.shape={jnp.shape(slot_indices)} must be [B]=({batch},)")
    layers, slots = pool.shape[:2]
    if not isinstance(layer_index, jax.core.Tracer) and not 0 <= int(layer_index) < layers:
        raise ValueError(f"layer_index={int(layer_index)} is outside the pool's {layers} layers")
    if not isinstance(slot_indices, jax.core.Tracer):
        indices = np.asarray(slot_indices)
        bad = (indices < 0) | (indices >= slots)
        if np.any(bad):
            raise ValueError(
                f"slot index {int(indices[np.argmax(bad)])} is outside the state buffer's {slots} slots"
            )
