"""`fused_recurrent_kda` in plain JAX: the KDA recurrence one token at a time, as a `lax.scan`.

The math-first reference of every other kernel here (as fla's `fla/ops/kda/naive.py` is for fla's):
inputs upcast to fp32 once, and the loop body (`recurrent_step`) is the recurrence line for line
(kda-layer step 6), per head, with state S `[K, V]`, q_t, k_t, g_t `[K]`, v_t `[V]`, beta_t a scalar:

    S = S * exp(g_t)[:, None]
    S = S + beta_t * outer(k_t, v_t - k_t @ S)
    o_t = (scale * q_t) @ S

The optimised chunked kernel (`chunk.py`) and the Pallas kernels are tested against it
(tests/kda_impl/test_kernels.py, test_pallas_kernels.py). g = -inf is a full reset (exp(g) = 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import HIGHEST, initial_or_zeros, prepare_inputs, sequence_ids
from kda_impl.kernels.validation import static_validate_inputs


def recurrent_step(
    state: jax.Array,  # [..., H, K, V] fp32
    q: jax.Array,  # [..., H, K] fp32, already scaled
    k: jax.Array,  # [..., H, K]
    v: jax.Array,  # [..., H, V]
    g: jax.Array,  # [..., H, K] log decay
    beta: jax.Array,  # [..., H]
) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence; returns (new state [..., H, K, V], o [..., H, V])."""
    state = state * jnp.exp(g)[..., None]
    predicted = jnp.einsum("...hk,...hkv->...hv", k, state, precision=HIGHEST)
    delta = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("...hk,...hkv->...hv", q, state, precision=HIGHEST)
    return state, o


def fused_recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    r"""KDA as a token recurrence (decode and short prefill).

    Args:
        q: queries `[B, T, H, K]`.
        k: keys `[B, T, H, K]`.
        v: values `[B, T, H, V]`.
        g: per-channel log decay (<= 0) `[B, T, H, K]`.
        beta: write strengths `[B, T, H]`.
        scale: query scale, default `K ** -0.5`.
        initial_state: `[N, H, K, V]`, N = B, or the number of sequences with `cu_seqlens`.
        output_final_state: return the final state of every sequence.
        cu_seqlens: `i32[N + 1]` offsets of a packed batch (then B must be 1).
        use_qk_l2norm_in_kernel: l2-normalise q and k (fp32) first.

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in q's dtype, final_state `[N, H, K, V]` fp32 or None.
    """
    shapes = static_validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    # Zeros are made here, not under jit: a call with and one without initial states share one program.
    init = initial_or_zeros(initial_state, shapes.state_shape)
    o, final = _fused_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        init,
        cu_seqlens,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o, (final if output_final_state else None)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm_in_kernel"))
def _fused_recurrent_kda(
    q: jax.Array,  # [B, T, H, K]
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K]
    beta: jax.Array,  # [B, T, H]
    init: jax.Array,  # [N, H, K, V] fp32
    cu_seqlens: jax.Array | None,  # i32[N + 1]
    *,
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[jax.Array, jax.Array]:
    out_dtype = q.dtype
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        o, final = _scan_equal_lengths(q * scale, k, v, g, beta, init)
    else:
        o, final = _scan_packed(q[0] * scale, k[0], v[0], g[0], beta[0], init, cu_seqlens)
        o = o[None]
    return o.astype(out_dtype), final


def _scan_equal_lengths(
    q: jax.Array,  # [B, T, H, K]
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K]
    beta: jax.Array,  # [B, T, H]
    init: jax.Array,  # [B, H, K, V]
) -> tuple[jax.Array, jax.Array]:
    """B sequences of the same length T, stepped together."""
    time_major = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))

    def step(state, token):
        return recurrent_step(state, *token)

    final, o = jax.lax.scan(step, init, time_major)
    return jnp.moveaxis(o, 0, 1), final


def _scan_packed(
    q: jax.Array,  # [T, H, K]
    k: jax.Array,  # [T, H, K]
    v: jax.Array,  # [T, H, V]
    g: jax.Array,  # [T, H, K]
    beta: jax.Array,  # [T, H]
    init: jax.Array,  # [N, H, K, V]
    cu_seqlens: jax.Array,  # i32[N + 1]
) -> tuple[jax.Array, jax.Array]:
    """A packed batch: one pass over the T tokens, the state reset at each sequence start."""
    tokens = q.shape[0]
    seq = sequence_ids(cu_seqlens, tokens)
    position = jnp.arange(tokens)
    is_first = position == cu_seqlens[seq]
    is_last = position == cu_seqlens[seq + 1] - 1

    def step(carry, token):
        state, finals = carry
        q_t, k_t, v_t, g_t, b_t, seq_t, first_t, last_t = token
        state = jnp.where(first_t, init[seq_t], state)
        state, o_t = recurrent_step(state, q_t, k_t, v_t, g_t, b_t)
        finals = finals.at[seq_t].set(jnp.where(last_t, state, finals[seq_t]))
        return (state, finals), o_t

    # Sequences of length zero keep their initial state: `finals` starts as `init`.
    (_, finals), o = jax.lax.scan(step, (init[0], init), (q, k, v, g, beta, seq, is_first, is_last))
    return o, finals
