"""`chunk_kda` in plain JAX: the chunked (WY) form of the KDA recurrence.

Per chunk of C tokens (per head), with G the in-chunk inclusive cumsum of the log decay g and
Γ = exp(G) (all factors below are <= 1, see "Strong decay"):

    A[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])          (j < i)
    Aqk[i, j] = scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])         (j <= i)
    U  = (I + A)^-1 (beta * v)          Wk = (I + A)^-1 (beta * k * Γ)
    w  = U - Wk @ S0                    (the new values written to the state)
    o  = scale * (q * Γ) @ S0 + Aqk @ w
    S1 = diag(Γ_C) S0 + (k * exp(G_C - G))^T @ w

S0 enters linearly, so everything but a `[K, K] x [K, V]` product per chunk is precomputed for all
chunks at once, and the `lax.scan` over chunks only carries S:
`S1 = M S0 + B` with `M = diag(Γ_C) - (k exp(G_C - G))^T Wk`, `B = (k exp(G_C - G))^T U`, and
`o = (scale q Γ - Aqk Wk) @ S0 + Aqk @ U`.

Strong decay: the factorised form `(q exp(G)) @ (k exp(-G))^T` overflows fp32 once -G passes ~88
(g reaches -60 per token). Here each chunk is split into sub-blocks of 16 rows. For the rows of
sub-block I, every earlier column j < s_I (s_I = first row of I) is factorised around G at s_I:
`exp(G_i - G_s) * exp(G_s - G_j)`, both factors <= 1. Inside the diagonal 16x16 blocks the decay is
applied element-wise, exactly.

Packed batches: every sequence is cut into its own chunks (the last one padded with zeros), so no
chunk holds two sequences, and the padded tail has k = v = beta = g = 0, which leaves the state exactly
unchanged. Shapes depend only on (T, N), never on the lengths: one compilation per (T, N).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.common import HIGHEST, initial_or_zeros, prepare_inputs, sequence_ids
from kda_impl.kernels.validation import static_validate_inputs

SUB_BLOCK = 16


def chunk_kda(
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
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    r"""KDA over whole sequences, chunk by chunk (prefill).

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
        chunk_size: tokens per chunk, a multiple of 16.

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in q's dtype, final_state `[N, H, K, V]` fp32 or None.
    """
    shapes = static_validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size % SUB_BLOCK or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_BLOCK}, got {chunk_size}")
    out_dtype = q.dtype
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    init = initial_or_zeros(initial_state, (shapes.num_seqs, shapes.heads, shapes.key_dim, shapes.value_dim))
    batch, tokens = shapes.batch, shapes.tokens
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(batch + 1, dtype=jnp.int32) * tokens
    flat = [x.reshape(batch * tokens, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final = _chunk_packed(*flat, init, jnp.asarray(cu_seqlens, jnp.int32), scale, chunk_size)
    o = o.reshape(batch, tokens, shapes.heads, shapes.value_dim)
    return o.astype(out_dtype), (final if output_final_state else None)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk of a packed batch comes from.

    token:    i32[NC, C] packed token index of each chunk row (0 where padded)
    valid:    bool[NC, C] whether that row is a real token
    seq:      i32[NC] sequence of each chunk (chunks past the last one repeat N-1, all rows invalid)
    is_first: bool[NC] the chunk starts its sequence
    slot:     i32[T] chunk of each packed token; row: i32[T] its row in that chunk
    last:     i32[N] last chunk of each sequence; nonempty: bool[N]
    """

    token: jax.Array
    valid: jax.Array
    seq: jax.Array
    is_first: jax.Array
    slot: jax.Array
    row: jax.Array
    last: jax.Array
    nonempty: jax.Array


def chunk_layout(cu_seqlens: jax.Array, tokens: int, chunk_size: int) -> ChunkLayout:
    """Cut every sequence of the packed batch into its own chunks; static size (T + N(C-1)) // C."""
    num_seqs = cu_seqlens.shape[0] - 1
    num_chunks = (tokens + num_seqs * (chunk_size - 1)) // chunk_size
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
    chunk_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(chunks_per_seq)]).astype(jnp.int32)
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    owner = jnp.searchsorted(chunk_offsets[1:], chunk, side="right").astype(jnp.int32)
    in_use = owner < num_seqs
    seq = jnp.minimum(owner, num_seqs - 1)
    local = chunk - chunk_offsets[seq]
    token = cu_seqlens[seq][:, None] + local[:, None] * chunk_size + jnp.arange(chunk_size)[None, :]
    valid = in_use[:, None] & (token < cu_seqlens[seq + 1][:, None])
    token_seq = sequence_ids(cu_seqlens, tokens)
    offset_in_seq = jnp.arange(tokens, dtype=jnp.int32) - cu_seqlens[token_seq]
    return ChunkLayout(
        token=jnp.where(valid, token, 0),
        valid=valid,
        seq=seq,
        is_first=in_use & (local == 0),
        slot=chunk_offsets[token_seq] + offset_in_seq // chunk_size,
        row=offset_in_seq % chunk_size,
        last=jnp.maximum(chunk_offsets[1:] - 1, 0),
        nonempty=lengths > 0,
    )


def _to_chunks(x: jax.Array, layout: ChunkLayout) -> jax.Array:
    """[T, H, ...] packed → [NC, H, C, ...] chunked, zeros in padded rows."""
    gathered = x[layout.token]  # [NC, C, H, ...]
    mask = layout.valid.reshape(layout.valid.shape + (1,) * (x.ndim - 1))
    return jnp.moveaxis(jnp.where(mask, gathered, 0), 2, 1)


def _chunk_packed(
    q: jax.Array,  # [T, H, K]
    k: jax.Array,  # [T, H, K]
    v: jax.Array,  # [T, H, V]
    g: jax.Array,  # [T, H, K]
    beta: jax.Array,  # [T, H]
    init: jax.Array,  # [N, H, K, V]
    cu_seqlens: jax.Array,  # i32[N + 1]
    scale: float,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    layout = chunk_layout(cu_seqlens, q.shape[0], chunk_size)
    qc, kc, vc, gc, bc = (_to_chunks(x, layout) for x in (q, k, v, g, beta))
    intra = intra_chunk(qc, kc, vc, gc, bc, scale)

    def step(state, chunk):
        u, w_k, k_to_end, decay_to_end, is_first, seq = chunk
        start = jnp.where(is_first, init[seq], state)
        new_values = u - jnp.einsum("hck,hkv->hcv", w_k, start, precision=HIGHEST)  # [H, C, V]
        end = decay_to_end[..., None] * start + jnp.einsum(
            "hck,hcv->hkv", k_to_end, new_values, precision=HIGHEST
        )
        return end, (start, new_values, end)

    _, (starts, new_values, ends) = jax.lax.scan(
        step,
        init[0],
        (intra.u, intra.w_k, intra.k_to_end, intra.decay_to_end, layout.is_first, layout.seq),
    )  # starts, ends: [NC, H, K, V] the state entering / leaving each chunk; new_values [NC, H, C, V]
    o_chunks = jnp.einsum("nhck,nhkv->nhcv", intra.q_decayed, starts, precision=HIGHEST) + jnp.einsum(
        "nhij,nhjv->nhiv", intra.a_qk, new_values, precision=HIGHEST
    )  # [NC, H, C, V]
    o = o_chunks[layout.slot, :, layout.row]  # [T, H, V]
    finals = jnp.where(layout.nonempty[:, None, None, None], ends[layout.last], init)
    return o, finals


@dataclasses.dataclass(frozen=True)
class IntraChunk:
    """The state-independent part of every chunk (see the module docstring), batched [NC, H, ...].

    q_decayed:    [NC, H, C, K]  scale * q * Γ
    a_qk:         [NC, H, C, C]  Aqk, lower triangle with the diagonal
    u:            [NC, H, C, V]  (I + A)^-1 (beta v)
    w_k:          [NC, H, C, K]  (I + A)^-1 (beta k Γ)
    k_to_end:     [NC, H, C, K]  k * exp(G_C - G), each row decayed to the chunk end
    decay_to_end: [NC, H, K]     Γ_C, the decay of the whole chunk
    """

    q_decayed: jax.Array
    a_qk: jax.Array
    u: jax.Array
    w_k: jax.Array
    k_to_end: jax.Array
    decay_to_end: jax.Array


def intra_chunk(
    q: jax.Array,  # [NC, H, C, K] fp32, l2-normalised
    k: jax.Array,  # [NC, H, C, K]
    v: jax.Array,  # [NC, H, C, V]
    g: jax.Array,  # [NC, H, C, K]
    beta: jax.Array,  # [NC, H, C]
    scale: float,
) -> IntraChunk:
    """All state-independent work of every chunk, batched over chunks and heads."""
    sums = segment_sums(g)
    a_qk, a_kk = decay_scores(q * scale, k, sums)
    a_kk = a_kk * beta[..., None]
    decay = jnp.exp(sums.prefix)  # Γ <= 1
    rhs = jnp.concatenate([v, k * decay], axis=-1) * beta[..., None]
    solved = jax.lax.linalg.triangular_solve(
        a_kk, rhs, left_side=True, lower=True, unit_diagonal=True
    )  # (I + A)^-1 [beta v | beta k Γ]
    value_dim = v.shape[-1]
    return IntraChunk(
        q_decayed=q * decay * scale,
        a_qk=a_qk,
        u=solved[..., :value_dim],
        w_k=solved[..., value_dim:],
        k_to_end=k * jnp.exp(sums.to_end),
        decay_to_end=decay[:, :, -1, :],
    )


@dataclasses.dataclass(frozen=True)
class SegmentSums:
    """Sums of g over the segments the decays need, each summed directly (never as a difference of
    two prefix sums, which loses ~eps*|prefix| to cancellation once strong decays precede weak ones).
    With s_I the first row of 16-row block I, and seg(a, b] = sum of g over rows a+1..b:

    prefix: [NC, H, C, K]          seg(-1, i], so Γ_i = exp(prefix_i)
    to_end: [NC, H, C, K]          seg(i, C-1], the decay from row i to the chunk end
    row:    [NC, H, nb, B, K]      seg(s_I, i] for row i of block I
    column: [NC, H, nb, C, K]      seg(j, s_I] for every column j < s_I (0 elsewhere)
    pair:   [NC, H, nb, B, B, K]   seg(j, i] for rows j <= i of block I (0 elsewhere)
    """

    prefix: jax.Array
    to_end: jax.Array
    row: jax.Array
    column: jax.Array
    pair: jax.Array


def segment_sums(g: jax.Array) -> SegmentSums:  # g: [NC, H, C, K]
    """All segment sums as products with constant 0/1 masks (exact weights, fp32 accumulation)."""
    chunks, heads, size, dim = g.shape
    blocks = size // SUB_BLOCK
    g_b = g.reshape(chunks, heads, blocks, SUB_BLOCK, dim)
    c = np.arange(size)
    b = np.arange(SUB_BLOCK)
    masked_sum = functools.partial(jnp.einsum, precision=HIGHEST)
    prefix = masked_sum("it,nhtk->nhik", jnp.asarray(c[None, :] <= c[:, None], g.dtype), g)
    to_end = masked_sum("it,nhtk->nhik", jnp.asarray(c[None, :] > c[:, None], g.dtype), g)
    row = masked_sum(
        "it,nhbtk->nhbik", jnp.asarray((b[None, :] > 0) & (b[None, :] <= b[:, None]), g.dtype), g_b
    )
    # seg(j, s_I] = (rest of j's own block after j) + (whole blocks strictly between) + g[s_I].
    rest_of_block = masked_sum("jt,nhbtk->nhbjk", jnp.asarray(b[None, :] > b[:, None], g.dtype), g_b)
    block_totals = jnp.sum(g_b, axis=3)  # [NC, H, nb, K]
    nb = np.arange(blocks)
    strictly_between = (nb[None, None, :] > nb[None, :, None]) & (nb[None, None, :] < nb[:, None, None])
    between = masked_sum("ijm,nhmk->nhijk", jnp.asarray(strictly_between, g.dtype), block_totals)
    column_block = c // SUB_BLOCK
    column = (
        rest_of_block.reshape(chunks, heads, 1, size, dim)
        + between[:, :, :, column_block, :]
        + g_b[:, :, :, :1, :]
    )  # [NC, H, nb, C, K]
    earlier = (column_block[None, :] < nb[:, None])[None, None, :, :, None]
    pair_mask = (b[None, None, :] > b[None, :, None]) & (b[None, None, :] <= b[:, None, None])
    pair = masked_sum("ijt,nhbtk->nhbijk", jnp.asarray(pair_mask, g.dtype), g_b)
    return SegmentSums(prefix, to_end, row, jnp.where(earlier, column, 0.0), pair)


def decay_scores(
    q: jax.Array,  # [NC, H, C, K]
    k: jax.Array,  # [NC, H, C, K]
    sums: SegmentSums,
) -> tuple[jax.Array, jax.Array]:
    """qk[i, j] (j <= i) and kk[i, j] (j < i) of `sum_d x_i[d] k_j[d] exp(seg(j, i][d])`.

    Never forms exp(+large): the rows of 16-row block I against the columns before it are factorised
    around s_I, `exp(seg(s_I, i]) * exp(seg(j, s_I])`, both factors <= 1 (and the product is accurate
    to ~eps * |exponent|, negligible once the product is); the diagonal 16x16 blocks use the exact
    element-wise decay exp(seg(j, i]). Returns two [NC, H, C, C], zero above the (strict) diagonal.
    """
    chunks, heads, size, dim = k.shape
    blocks = size // SUB_BLOCK
    as_blocks = lambda x: x.reshape(chunks, heads, blocks, SUB_BLOCK, dim)  # noqa: E731
    q_b, k_b = as_blocks(q), as_blocks(k)

    row_decay = jnp.exp(sums.row)  # [NC, H, nb, B, K]
    rows = jnp.concatenate([q_b * row_decay, k_b * row_decay], axis=3)  # [NC, H, nb, 2B, K]
    columns = k[:, :, None] * jnp.exp(sums.column)  # [NC, H, nb, C, K]
    off = jnp.einsum("nhirk,nhick->nhirc", rows, columns, precision=HIGHEST)  # [NC, H, nb, 2B, C]

    b = jnp.arange(SUB_BLOCK)
    pair_decay = jnp.where((b[:, None] >= b[None, :])[..., None], jnp.exp(sums.pair), 0.0)
    diag_qk = jnp.sum(q_b[..., :, None, :] * k_b[..., None, :, :] * pair_decay, axis=-1)
    diag_kk = jnp.sum(k_b[..., :, None, :] * k_b[..., None, :, :] * pair_decay, axis=-1)
    diag_kk = jnp.where(b[:, None] > b[None, :], diag_kk, 0.0)
    diag = jnp.concatenate([diag_qk, diag_kk], axis=3)  # [NC, H, nb, 2B, B]

    column_block = jnp.arange(size) // SUB_BLOCK
    off = jnp.where(column_block[None, None, :] < jnp.arange(blocks)[:, None, None], off, 0.0)
    per_block = [
        jax.lax.dynamic_update_slice_in_dim(off[:, :, i], diag[:, :, i], i * SUB_BLOCK, axis=3)
        for i in range(blocks)
    ]
    scores = jnp.stack(per_block, axis=2)  # [NC, H, nb, 2B, C]
    qk = scores[:, :, :, :SUB_BLOCK].reshape(chunks, heads, size, size)
    kk = scores[:, :, :, SUB_BLOCK:].reshape(chunks, heads, size, size)
    return qk, kk
