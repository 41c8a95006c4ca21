"""`chunk_kda` in plain JAX: the chunked (WY) form of the KDA recurrence, exact in fp32.

Not a naive kernel: it computes the token recurrence of `naive_recurrent.py` (the math-first reference
the tests hold it to) C tokens at a time, with the in-chunk decay scores built by recursive halving and
`(I + A)^-1` by a recursive block inverse, all in batched matmuls.

Per chunk of C tokens (per head), with G the in-chunk inclusive cumsum of the log decay g and
Γ = exp(G) (all factors below are <= 1, see "Strong decay"):

    A[i, j]   = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])          (j < i)
    Aqk[i, j] = scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])         (j <= i)
    U  = (I + A)^-1 (beta * v)          Wk = (I + A)^-1 (beta * k * Γ)
    w  = U - Wk @ S0                    (the new values written to the state)
    o  = scale * (q * Γ) @ S0 + Aqk @ w
    S1 = diag(Γ_C) S0 + (k * exp(G_C - G))^T @ w

Everything state-independent (scores, inverse, U, Wk, decays) is computed for all chunks at once
(`intra_chunk`); the `lax.scan` over chunks carries only S and does the two products that need it.

Strong decay: the factorised form `(q exp(G)) @ (k exp(-G))^T` overflows fp32 once -G passes ~88
(g reaches -60 per token), and `exp(G_i - G_j)` from two long prefix sums loses ~eps*|G| to
cancellation once strong decays precede weak ones. Here no exponent is ever a difference: Γ and the
decay to the chunk end are exps of one-segment sums, and the in-chunk scores are built by recursive
halving, each lower-left quadrant factorised around its middle row into two products of per-token
decays exp(g) <= 1 (`decay_scores`).

Packed batches: every sequence is cut into its own chunks (the last one padded with zeros), so no
chunk holds two sequences, and the padded tail has k = v = beta = g = 0, which leaves the state exactly
unchanged. Shapes depend only on (T, N), never on the lengths: one compilation per (T, N).

Full resets: g = -inf is floored (`common.finite_log_decay`) to the same exact exp 0, never 0 * -inf.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.common import HIGHEST, finite_log_decay, initial_or_zeros, prepare_inputs, sequence_ids
from kda_impl.kernels.validation import static_validate_inputs


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
        chunk_size: tokens per chunk, a power of two.

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in q's dtype, final_state `[N, H, K, V]` fp32 or None.
    """
    shapes = static_validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(shapes.batch + 1, dtype=jnp.int32) * shapes.tokens
    o, final = _chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        jnp.asarray(cu_seqlens, jnp.int32),
        scale=scale,
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o, (final if output_final_state else None)


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "use_qk_l2norm_in_kernel"))
def _chunk_kda(
    q: jax.Array,  # [B, T, H, K]
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K]
    beta: jax.Array,  # [B, T, H]
    initial_state: jax.Array | None,  # [N, H, K, V]
    cu_seqlens: jax.Array,  # i32[N + 1], offsets into the B*T flattened tokens
    *,
    scale: float | None,
    chunk_size: int,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[jax.Array, jax.Array]:
    batch, tokens, heads, _ = q.shape
    out_dtype = q.dtype
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    init = initial_or_zeros(initial_state, (cu_seqlens.shape[0] - 1, heads, k.shape[-1], v.shape[-1]))
    flat = [x.reshape(batch * tokens, *x.shape[2:]) for x in (q, k, v, finite_log_decay(g), beta)]
    o, final = _chunk_packed(*flat, init, cu_seqlens, scale, chunk_size)
    return o.reshape(batch, tokens, heads, v.shape[-1]).astype(out_dtype), final


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
    size = g.shape[2]
    rows = np.arange(size)
    # Prefix sums from the chunk start and suffix sums to its end are sums of one segment each (no
    # difference of two long sums): accurate whatever decays came before.
    prefix = jnp.einsum(
        "it,nhtk->nhik", jnp.asarray(rows[None, :] <= rows[:, None], g.dtype), g, precision=HIGHEST
    )
    to_end = jnp.einsum(
        "it,nhtk->nhik", jnp.asarray(rows[None, :] > rows[:, None], g.dtype), g, precision=HIGHEST
    )
    a_qk, a_kk = decay_scores(q * scale, k, g)
    a_kk = a_kk * beta[..., None]
    decay = jnp.exp(prefix)  # Γ <= 1
    rhs = jnp.concatenate([v, k * decay], axis=-1) * beta[..., None]
    solved = jnp.einsum(
        "nhij,nhjk->nhik", unit_lower_inverse(a_kk), rhs, precision=HIGHEST
    )  # (I + A)^-1 [beta v | beta k Γ]
    value_dim = v.shape[-1]
    return IntraChunk(
        q_decayed=q * decay * scale,
        a_qk=a_qk,
        u=solved[..., :value_dim],
        w_k=solved[..., value_dim:],
        k_to_end=k * jnp.exp(to_end),
        decay_to_end=decay[:, :, -1, :],
    )


def _masked_row_sums(mask: np.ndarray, g: jax.Array) -> jax.Array:
    """out[i] = sum_t mask[i, t] * g[t] along the chunk rows: [C, C] bool, [NC, H, C, K] → [NC, H, C, K]."""
    return jnp.einsum("it,nhtk->nhik", jnp.asarray(mask, g.dtype), g, precision=HIGHEST)


def decay_scores(
    q: jax.Array,  # [NC, H, C, K]
    k: jax.Array,  # [NC, H, C, K]
    g: jax.Array,  # [NC, H, C, K] log decay per row, <= 0
) -> tuple[jax.Array, jax.Array]:
    """qk[i, j] (j <= i) and kk[i, j] (j < i) of `sum_d x_i[d] k_j[d] exp(g_{j+1}[d] + ... + g_i[d])`.

    The lower triangle is built by recursive halving. A group of 2h rows splits at its middle row m;
    every (i, j) with i in the lower half and j in the upper half is factorised around m:
    `exp(g_{m+1} + .. + g_i) * exp(g_{j+1} + .. + g_m)`, both exponents one-segment sums <= 0, so
    nothing overflows and nothing cancels. Each (i > j) falls in exactly one such quadrant; the
    diagonal is q_i . k_i. Level h fills C/(2h) h x h quadrants per matrix: C*h*K multiply-adds for the
    two, about C^2 K over the log2(C) levels (as a direct masked product). Returns two [NC, H, C, C].
    """
    size, dim = k.shape[2:]
    # blocks: [2, NC, H, groups, h, h] the qk and kk lower-triangular diagonal blocks, from h = 1.
    rows = jnp.stack([q, k])  # [2, NC, H, C, K]
    blocks = jnp.stack([jnp.sum(q * k, axis=-1), jnp.zeros(q.shape[:-1], q.dtype)])[..., None, None]
    half = 1
    while half < size:
        groups = size // (2 * half)
        grouped = lambda x: x.reshape(*x.shape[:-2], groups, 2 * half, dim)  # noqa: E731, B023
        upper_g, lower_g = grouped(g)[..., :half, :], grouped(g)[..., half:, :]
        # Row i of the lower half: g over (m, i]; column j of the upper half: g over (j, m].
        row_factor = jnp.exp(jnp.cumsum(lower_g.at[..., 0, :].set(0.0), axis=-2))
        to_middle = jnp.concatenate([upper_g[..., 1:, :], lower_g[..., :1, :]], axis=-2)
        column_factor = jnp.exp(jax.lax.cumsum(to_middle, axis=to_middle.ndim - 2, reverse=True))
        columns = grouped(k)[..., :half, :] * column_factor
        lower_rows = grouped(rows)[..., half:, :] * row_factor
        quadrant = jnp.einsum("xnhgik,nhgjk->xnhgij", lower_rows, columns, precision=HIGHEST)
        blocks = _merge_blocks(blocks, quadrant)
        half *= 2
    return blocks[0, :, :, 0], blocks[1, :, :, 0]


def _merge_blocks(
    blocks: jax.Array,  # [..., 2G, h, h] lower-triangular blocks along the diagonal
    quadrant: jax.Array,  # [..., G, h, h] the lower-left quadrant of each merged block
) -> jax.Array:
    """`[[top, 0], [quadrant, bottom]]` for each pair of consecutive blocks: [..., G, 2h, 2h]."""
    top, bottom = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
    upper = jnp.concatenate([top, jnp.zeros_like(top)], axis=-1)
    return jnp.concatenate([upper, jnp.concatenate([quadrant, bottom], axis=-1)], axis=-2)


def unit_lower_inverse(a: jax.Array) -> jax.Array:  # a: [NC, H, C, C] strictly lower triangular
    """(I + a)^-1 by recursive halving: inv([[L1, 0], [B, L2]]) = [[L1^-1, 0], [-L2^-1 B L1^-1, L2^-1]].

    Block forward substitution (as fla's solve_tril), all in batched matmuls: no triangular_solve,
    which is slow for many small systems on CPU and absent from Pallas TPU. Returns [NC, H, C, C].
    """
    chunks, heads, size, _ = a.shape
    inverse = jnp.ones((chunks, heads, size, 1, 1), a.dtype)  # the 1x1 diagonal blocks of I + a
    half = 1
    while half < size:
        groups = size // (2 * half)
        grouped = a.reshape(chunks, heads, groups, 2 * half, groups, 2 * half)
        index = jnp.arange(groups)
        lower_left = jnp.moveaxis(grouped[:, :, index, half:, index, :half], 0, 2)  # [NC, H, G, h, h]
        top, bottom = inverse[:, :, 0::2], inverse[:, :, 1::2]
        quadrant = -jnp.einsum("nhgij,nhgjk,nhgkl->nhgil", bottom, lower_left, top, precision=HIGHEST)
        inverse = _merge_blocks(inverse, quadrant)
        half *= 2
    return inverse[:, :, 0]
