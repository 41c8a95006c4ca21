"""Decode in plain JAX: one token for each of B requests, states read from and written to pool slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import prepare_inputs
from kda_impl.kernels.naive_recurrent import recurrent_step


def decode_kda_slots(
    q: jax.Array,  # [B, H, K]
    k: jax.Array,  # [B, H, K]
    v: jax.Array,  # [B, H, V]
    g: jax.Array,  # [B, H, K]
    beta: jax.Array,  # [B, H]
    *,
    state_buffer: jax.Array,  # [S, H, K, V] fp32, one layer of the state pool
    slot_indices: jax.Array,  # i32[B]
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per request on its own slot's state.

    Gathers the B states, steps them and scatters them back; the other slots are untouched.
    Returns `(o [B, H, V] in q's dtype, the updated state_buffer)`.
    """
    validate_decode_inputs(q, k, v, g, beta, state_buffer, slot_indices)
    out_dtype = q.dtype
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    state_buffer = jnp.asarray(state_buffer)
    states = state_buffer[slot_indices].astype(jnp.float32)
    states, o = recurrent_step(states, q * scale, k, v, g, beta)
    return o.astype(out_dtype), state_buffer.at[slot_indices].set(states.astype(state_buffer.dtype))


def validate_decode_inputs(
    q: jax.Array,  # [B, H, K]
    k: jax.Array,  # [B, H, K]
    v: jax.Array,  # [B, H, V]
    g: jax.Array,  # [B, H, K]
    beta: jax.Array,  # [B, H]
    state_buffer: jax.Array,  # [S, H, K, V]
    slot_indices: jax.Array,  # i32[B]
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
    if state_buffer.ndim != 4 or state_buffer.shape[1:] != expected_state:
        raise ValueError(
            f"state_buffer must be [slots, H, K, V] with [H, K, V]={expected_state}, got {state_buffer.shape}"
        )
    if slot_indices.shape != (batch,):
        raise ValueError(f"slot_indices.shape={slot_indices.shape} must be [B]=({batch},)")
    if not isinstance(slot_indices, jax.core.Tracer):
        slots = jnp.asarray(slot_indices)
        bad = (slots < 0) | (slots >= state_buffer.shape[0])
        if bool(jnp.any(bad)):
            raise ValueError(
                f"slot index {int(slots[jnp.argmax(bad)])} is outside the state buffer's "
                f"{state_buffer.shape[0]} slots"
            )
