"""`reference_chunk_kda`: the chunked form of the KDA recurrence in plain JAX, written to be read.

The chunk form's reference, as fla's `naive_chunk_kda` (`fla/ops/kda/naive.py`) is beside its fast
kernels: the tests hold `chunk.py` and `pallas/chunk.py` to it, and it to the token recurrence
(`recurrent.py`). One sequence and one chunk at a time, every matrix as the equations write it,
in fla's names. Per chunk of C tokens and per head, with S the state entering the chunk, G the in-chunk
inclusive cumsum of g and Γ = exp(G):

    Akk[i, j] = beta_i Σ_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i)
    Aqk[i, j] = Σ_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])              (j <= i; q scaled)
    u = (I + Akk)^-1 (beta v)          w = (I + Akk)^-1 (beta k Γ)
    v_new = u - w S                    (the values the chunk writes into the state)
    o = (q Γ) S + Aqk v_new
    S' = diag(Γ_C) S + (k exp(G_C - G))^T v_new

It computes in float32, or in float64 for float64 inputs (under `jax.enable_x64(True)`), where it is
exact to float64 rounding. In float32, `G_i - G_j` is a difference of two long sums and loses about
eps·|G_i| once strong decays precede weak ones: the chunk kernels never form it.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from kda_impl.kernels.common import HIGHEST, L2NORM_EPS, KdaInputs, finite_log_decay
from kda_impl.kernels.validation import static_validate_inputs


def reference_chunk_kda(
    q: jax.Array,  # [B, T, H, K]
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K] log decay (<= 0)
    beta: jax.Array,  # [B, T, H]
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [N, H, K, V]
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,  # i32[N + 1], concrete: a Python loop runs over the sequences
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """`chunk_kda`'s arguments and results (o in q's dtype, the final states in the compute dtype)."""
    shapes = static_validate_inputs(KdaInputs(q, k, v, g, beta), initial_state, cu_seqlens)
    out_shape, out_dtype, dtype = v.shape, q.dtype, jnp.promote_types(q.dtype, jnp.float32)
    # The B rows one after another, heads first: [H, B * T, ...].
    q, k, v, g, beta = (
        jnp.swapaxes(jnp.asarray(x, dtype).reshape(-1, *x.shape[2:]), 0, 1) for x in (q, k, v, g, beta)
    )
    if use_qk_l2norm_in_kernel:
        q, k = (x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS) for x in (q, k))
    q = q * (shapes.key_dim**-0.5 if scale is None else scale)
    g = finite_log_decay(g)  # g = -inf would make G_i - G_j = -inf + inf
    states = (
        jnp.zeros(shapes.state_shape, dtype) if initial_state is None else jnp.asarray(initial_state, dtype)
    )
    offsets = np.arange(shapes.batch + 1) * shapes.tokens if cu_seqlens is None else np.asarray(cu_seqlens)
    outputs, finals = [], []
    for state, (start, end) in zip(states, itertools.pairwise(offsets.tolist()), strict=True):
        # The sequence in whole chunks: zero rows pad the last one, and leave the state unchanged.
        padding = [(0, 0), (0, -(end - start) % chunk_size)]
        seq = [jnp.pad(x[:, start:end], padding + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta)]
        chunk_outputs = [v[:, :0]]
        for first in range(0, end - start, chunk_size):
            o, state = chunk(*(x[:, first : first + chunk_size] for x in seq), state)
            chunk_outputs.append(o)
        outputs.append(jnp.concatenate(chunk_outputs, axis=1)[:, : end - start])
        finals.append(state)
    o = jnp.swapaxes(jnp.concatenate(outputs, axis=1), 0, 1).reshape(out_shape).astype(out_dtype)
    return o, (jnp.stack(finals) if output_final_state else None)


def chunk(
    q: jax.Array,  # [H, C, K] scaled
    k: jax.Array,  # [H, C, K]
    v: jax.Array,  # [H, C, V]
    g: jax.Array,  # [H, C, K]
    beta: jax.Array,  # [H, C]
    state: jax.Array,  # [H, K, V] S, entering the chunk
) -> tuple[jax.Array, jax.Array]:
    """One chunk of one sequence, as the module docstring writes it: (o [H, C, V], S')."""
    G = jnp.cumsum(g, axis=1)
    gamma = jnp.exp(G)  # Γ
    causal = jnp.tril(jnp.ones((g.shape[1],) * 2, bool))[..., None]  # j <= i
    pair_decay = jnp.exp(jnp.where(causal, G[:, :, None] - G[:, None], -jnp.inf))  # [H, C, C, K]
    aqk = jnp.sum(q[:, :, None] * k[:, None] * pair_decay, axis=-1)  # [H, C, C]
    akk = jnp.sum(k[:, :, None] * k[:, None] * pair_decay, axis=-1) * beta[..., None]

    def solve(x: jax.Array) -> jax.Array:  # (I + Akk)^-1 (beta x): Akk's diagonal is never read
        return solve_triangular(akk, beta[..., None] * x, lower=True, unit_diagonal=True)

    u, w = solve(v), solve(k * gamma)
    v_new = u - jnp.matmul(w, state, precision=HIGHEST)
    o = jnp.matmul(q * gamma, state, precision=HIGHEST) + jnp.matmul(aqk, v_new, precision=HIGHEST)
    kg = k * jnp.exp(G[:, -1:] - G)  # k decayed to the chunk end
    state = gamma[:, -1, :, None] * state + jnp.matmul(jnp.swapaxes(kg, 1, 2), v_new, precision=HIGHEST)
    return o, state
