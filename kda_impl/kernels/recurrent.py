"""`fused_recurrent_kda` in plain JAX: the KDA recurrence one token at a time, as a `lax.scan`.

The math-first reference of every other kernel here (as fla's `fla/ops/kda/naive.py` is for fla's):
inputs upcast to fp32 once, and the loop body (`recurrent_step`) is the recurrence line for line
(kda-layer step 6), per head, with state S `[K, V]`, q_t, k_t, g_t `[K]`, v_t `[V]`, beta_t a scalar:

    S = S * exp(g_t)[:, None]
    S = S + beta_t * outer(k_t, v_t - k_t @ S)
    o_t = (scale * q_t) @ S

The chunk form's readable reference (`reference_chunk.py`) and the Pallas recurrent kernel are tested against
it (tests/kda_impl/test_kernels.py, test_pallas_kernels.py). g = -inf is a full reset (exp(g) = 0).
`entry.fla_entry` (`entry.py`) gives it fla's calling convention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import HIGHEST, KdaInputs, PackedInputs, sequence_ids
from kda_impl.kernels.entry import FlaResult, fla_entry


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


def _packed_fused_recurrent_kda(packed: PackedInputs, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """The kernel of `fused_recurrent_kda` on the packed batch (`entry.fla_entry`)."""
    inputs = packed.inputs.scaled(scale)
    if packed.cu_seqlens is None:  # N rows of equal length, one sequence each: stepped together
        rows = inputs.map(lambda x: x.reshape(packed.init.shape[0], -1, *x.shape[1:]))
        o, final = _scan_equal_lengths(rows, packed.init)
        return o.reshape(-1, *o.shape[2:]), final
    return _scan_packed(inputs, packed.init, packed.cu_seqlens)


_FUSED_RECURRENT_KDA = fla_entry(_packed_fused_recurrent_kda)


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
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,  # fla's name
    dt_bias: jax.Array | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
) -> FlaResult:
    """KDA as a token recurrence (decode and short prefill).

    fla's calling convention: the arguments and the result of `kda_impl.kernels.entry`, then the
    kernel's own options."""
    return _FUSED_RECURRENT_KDA(**locals())  # every argument as written above


def _scan_equal_lengths(
    rows: KdaInputs,  # [B, T, H, ...], q scaled
    init: jax.Array,  # [B, H, K, V]
) -> tuple[jax.Array, jax.Array]:
    """B sequences of the same length T, stepped together."""
    time_major = rows.map(lambda x: jnp.moveaxis(x, 1, 0))

    def step(state, token):
        return recurrent_step(state, *token)

    final, o = jax.lax.scan(step, init, time_major)
    return jnp.moveaxis(o, 0, 1), final


def _scan_packed(
    inputs: KdaInputs,  # [T, H, ...] packed, q scaled
    init: jax.Array,  # [N, H, K, V]
    cu_seqlens: jax.Array,  # i32[N + 1]
) -> tuple[jax.Array, jax.Array]:
    """A packed batch: one pass over the T tokens, the state reset at each sequence start."""
    tokens = inputs.q.shape[0]
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
    (_, finals), o = jax.lax.scan(step, (init[0], init), (*inputs, seq, is_first, is_last))
    return o, finals
