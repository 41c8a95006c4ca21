"""`chunk_kda` in plain JAX: the chunked (WY) form of the KDA recurrence, exact in fp32.

Not a naive kernel: it computes the token recurrence of `recurrent.py` (the math-first reference
the tests hold it to) C tokens at a time, with the in-chunk decay scores built by recursive halving and
`(I + A)^-1` by a recursive block inverse, in batched matmuls (element-wise products for the smallest
blocks).

Per chunk of C tokens (per head), with G the in-chunk inclusive cumsum of the log decay g and
Γ = exp(G), in fla's names (`reference_chunk.py` computes them as written; all factors below are <= 1,
see "Strong decay"):

    Akk[i, j] = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])        (j < i)
    Aqk[i, j] = scale * sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])         (j <= i)
    u = (I + Akk)^-1 (beta * v)         w = (I + Akk)^-1 (beta * k * Γ)
    v_new = u - w @ S                   (the values the chunk writes into the state)
    o  = scale * (q * Γ) @ S + Aqk @ v_new
    S' = diag(Γ_C) S + (k * exp(G_C - G))^T @ v_new

Implementation: one `lax.scan` step per chunk (`chunk_step`), batched over heads; v_new is computed as
(I + Akk)^-1 (beta * v - (beta * k * Γ) @ S), one solve of V columns instead of V + K, and one matmul
`[beta k Γ ; scale q Γ] @ S` serves both state products. Working chunk by chunk keeps every temporary
at `[H, C, ...]` (cache-sized): on XLA:CPU an all-chunks-at-once form spends most of its time
streaming `[NC, H, C, K]` temporaries through memory.

Strong decay: the factorised form `(q exp(G)) @ (k exp(-G))^T` overflows fp32 once -G passes ~88
(g reaches -60 per token), and `exp(G_i - G_j)` from two long prefix sums loses ~eps*|G| to
cancellation once strong decays precede weak ones. Here no exponent is ever a difference: every decay
factor is a product of per-token decays exp(g) <= 1 over one segment (`decay_factors`: within aligned
blocks of 1, 2, 4, .., C rows; Γ and the decay to the chunk end are its top level), and the in-chunk
scores are built by recursive halving, each lower-left quadrant factorised around its middle row into
two such factors (`decay_scores`). Every exp argument is a single g <= 0: nothing overflows.

Packed batches: every sequence is cut into its own chunks (the last one padded with zeros), so no
chunk holds two sequences, and the padded rows have k = v = beta = g = 0, which leave the state exactly
unchanged. A chunk reads C consecutive rows of the packed inputs in place, masking the rows that are
not its own; within C rows of the end of the array the window is the last C rows, so there its tokens
follow the masked rows instead of preceding them. Shapes depend only on (T, N), never on the lengths:
one compilation per (T, N).

Full resets: g = -inf is floored (`common.finite_log_decay`) to the same exact exp 0, never 0 * -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import HIGHEST, PackedInputs, chunk_layout, finite_log_decay
from kda_impl.kernels.entry import FlaResult, fla_entry
from kda_impl.kernels.options import validate_chunk_size

# Tokens per chunk: the in-chunk work grows as C^2 per chunk while the state products cost the same per
# token for any C; on XLA:CPU 32 is the fastest (see CHANGELOG.md), fla uses 64.
CHUNK_SIZE = 32


def _packed_chunk_kda(
    packed: PackedInputs, *, scale: float, chunk_size: int, return_intermediate_states: bool = False
) -> tuple[jax.Array, ...]:
    """The kernel of `chunk_kda` on the packed batch (`entry.fla_entry`): one `lax.scan` step per chunk,
    its rows sliced from the packed inputs and the whole chunk computed there (`chunk_step`), so every
    temporary is one chunk's `[H, C, ...]`, cache-sized. Any power-of-two `chunk_size` (the public
    `chunk_kda` takes fla's 32 and 64). Returns (o, finals), and with `return_intermediate_states` the
    state entering each chunk `[NC, H, K, V]`."""
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    q, k, v, g, beta = packed.inputs._replace(g=finite_log_decay(packed.inputs.g))
    init, cu_seqlens = packed.init, packed.offsets()
    tokens = q.shape[0]
    if tokens < chunk_size:  # a chunk's window of C rows must fit in the array
        fill = chunk_size - tokens
        q, k, v, g, beta = (jnp.pad(x, [(0, fill)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    layout = chunk_layout(cu_seqlens, tokens, chunk_size)
    first_token = layout.token[:, 0]
    end_token = first_token + jnp.sum(layout.valid, axis=1)
    # A chunk reads the C rows from its first token, or, within C of the end of the array, the last C
    # rows: its tokens then sit at the bottom of the window, below masked rows. No padded copy of the
    # inputs is made, which would be one more pass over all of them.
    window_start = jnp.minimum(first_token, q.shape[0] - chunk_size)

    def step(carry, chunk):
        state, finals = carry
        start_row, first, end, is_first, seq, is_last = chunk
        position = start_row + jnp.arange(chunk_size, dtype=jnp.int32)
        valid = (position >= first) & (position < end)
        rows = [_chunk_rows(x, start_row, valid) for x in (q, k, v, g, beta)]
        start = jax.lax.cond(is_first, lambda s: init[seq], lambda s: s, state)  # a sequence starts
        o, end_state = recomputed_chunk_step(*rows, start, scale)
        # Only a sequence's last chunk writes its final state (a branch: no state-sized write per chunk).
        finals = jax.lax.cond(
            is_last, lambda f: jax.lax.dynamic_update_index_in_dim(f, end_state, seq, 0), lambda f: f, finals
        )
        return (end_state, finals), ((o, start) if return_intermediate_states else o)

    chunk_index = jnp.arange(layout.seq.shape[0], dtype=jnp.int32)
    is_last = layout.nonempty[layout.seq] & (chunk_index == layout.last[layout.seq])
    (_, finals), per_chunk = jax.lax.scan(
        step,
        (init[0], init),
        (window_start, first_token, end_token, layout.is_first, layout.seq, is_last),
    )
    o_chunks, starts = per_chunk if return_intermediate_states else (per_chunk, None)  # [NC, H, C, V]
    rows = jnp.moveaxis(o_chunks, 1, 2).reshape(-1, *o_chunks.shape[1:2], o_chunks.shape[-1])  # [NC*C, H, V]
    row_in_window = jnp.arange(tokens, dtype=jnp.int32) - window_start[layout.slot]
    o = rows[layout.slot * chunk_size + row_in_window]
    return (o, finals, starts) if return_intermediate_states else (o, finals)


_CHUNK_KDA = fla_entry(_packed_chunk_kda, static=("chunk_size", "return_intermediate_states"), chunked=True)


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
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,  # fla's name
    dt_bias: jax.Array | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
    return_intermediate_states: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> FlaResult:
    """KDA over whole sequences, chunk by chunk (prefill).

    fla's calling convention: the arguments and the result of `kda_impl.kernels.entry`, then the
    kernel's own options.

    Args:
        return_intermediate_states: also return h, the state entering every chunk (`entry`).
        chunk_size: tokens per chunk, 32 or 64 as in fla (default `CHUNK_SIZE`).
    """
    validate_chunk_size(chunk_size)
    return _CHUNK_KDA(**locals())  # every argument as written above


def _chunk_rows(x: jax.Array, start_row: jax.Array, valid: jax.Array) -> jax.Array:
    """The C rows of packed `x` [T, H, ...] from `start_row`: [H, C, ...], 0 where not `valid`."""
    size = valid.shape[0]
    window = jax.lax.dynamic_slice_in_dim(x, start_row, size, axis=0)
    return jnp.moveaxis(jnp.where(valid.reshape((size,) + (1,) * (x.ndim - 1)), window, 0), 0, 1)


def chunk_step(
    q: jax.Array,  # [H, C, K] fp32, l2-normalised
    k: jax.Array,  # [H, C, K]
    v: jax.Array,  # [H, C, V]
    g: jax.Array,  # [H, C, K] log decay, floored (finite)
    beta: jax.Array,  # [H, C]
    start: jax.Array,  # [H, K, V] the state entering the chunk
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """One chunk (see the module docstring): (o [H, C, V], the state leaving it [H, K, V])."""
    size = g.shape[-2]
    prefix, suffix = decay_factors(g)
    aqk, kk = decay_scores(q * scale, k, prefix, suffix)  # Aqk, and Akk before its beta
    akk_inverse = unit_lower_inverse(kk * beta[..., None])  # (I + Akk)^-1
    gamma, to_end = prefix[-1], suffix[-1]  # Γ = exp(G), exp(G_C - G)
    # The state's two products in one: [beta k Γ ; scale q Γ] @ S.
    rows = jnp.concatenate([k * gamma * beta[..., None], q * gamma * scale], axis=-2)  # [H, 2C, K]
    rows_s = jnp.einsum("hck,hkv->hcv", rows, start, precision=HIGHEST)
    v_new = jnp.einsum(
        "hij,hjv->hiv", akk_inverse, v * beta[..., None] - rows_s[:, :size], precision=HIGHEST
    )  # u - w S = (I + Akk)^-1 (beta v - beta k Γ S)
    kg = k * to_end  # k decayed to the chunk end
    end = gamma[:, -1, :, None] * start + jnp.einsum("hck,hcv->hkv", kg, v_new, precision=HIGHEST)
    o = rows_s[:, size:] + jnp.einsum("hij,hjv->hiv", aqk, v_new, precision=HIGHEST)
    return o, end


# `chunk_step` as the scan runs it: under differentiation the backward recomputes each chunk's step from
# the state entering it instead of keeping the step's intermediates (fla's chunk backward recomputes its
# states too), so the residuals are about a state per chunk and the vjp's program compiles in about half
# the time (XLA:CPU, 1024 tokens of 2 heads of 64: 5.0 s against 8.8 s). The forward alone compiles to
# the same program.
recomputed_chunk_step = jax.checkpoint(chunk_step, static_argnums=(6,))


def decay_factors(g: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per-channel decays within aligned row blocks of every size 1, 2, 4, .., C, as products of exp(g).

    `prefix[l][i] = exp(g_b + .. + g_i)` and `suffix[l][i] = exp(g_{i+1} + .. + g_e)`, where [b, e] is
    the aligned block of 2^l rows holding row i: one-segment decays, each <= 1. Level l+1 multiplies the
    second half of each block by the first half's total (prefix) and the first half by the second
    half's total (suffix): products of factors <= 1, no exponent difference, no overflow, a few ulp of
    rounding. `prefix[-1]` is Γ (decay from the chunk start), `suffix[-1]` the decay to the chunk end.
    Returns two lists of log2(C) + 1 arrays shaped like g.
    """
    *lead, size, dim = g.shape
    prefix, suffix = [jnp.exp(g)], [jnp.ones_like(g)]
    half = 1
    while half < size:
        groups = size // (2 * half)
        pre = prefix[-1].reshape(*lead, groups, 2, half, dim)
        suf = suffix[-1].reshape(*lead, groups, 2, half, dim)
        first_total, second_total = pre[..., 0, -1:, :], pre[..., 1, -1:, :]
        prefix.append(jnp.stack([pre[..., 0, :, :], pre[..., 1, :, :] * first_total], -3).reshape(g.shape))
        suffix.append(jnp.stack([suf[..., 0, :, :] * second_total, suf[..., 1, :, :]], -3).reshape(g.shape))
        half *= 2
    return prefix, suffix


def decay_scores(
    q: jax.Array,  # [..., C, K] (scaled)
    k: jax.Array,  # [..., C, K]
    prefix: list[jax.Array],  # decay_factors(g)
    suffix: list[jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """qk[i, j] (j <= i) and kk[i, j] (j < i) of `sum_d x_i[d] k_j[d] exp(g_{j+1}[d] + ... + g_i[d])`.

    The lower triangle is built by recursive halving. A group of 2h rows splits after its middle row m;
    every (i, j) with i in the lower half and j in the upper half is factorised around m:
    `exp(g_{m+1} + .. + g_i) * exp(g_{j+1} + .. + g_m)` = `prefix[l][i] * suffix[l][j]` (h = 2^l), both
    <= 1, so nothing overflows and nothing cancels. Each (i > j) falls in exactly one such quadrant; the
    diagonal is q_i . k_i. Level h fills C/(2h) h x h quadrants per matrix, in one batched matmul for
    the two matrices. Returns two [..., C, C].
    """
    size, dim = k.shape[-2:]
    rows = jnp.stack([q, k])  # [2, ..., C, K]
    diagonal = jnp.einsum("...k,...k->...", q, k, precision=HIGHEST)
    blocks = jnp.stack([diagonal, jnp.zeros_like(diagonal)])[..., None, None]  # [2, ..., C, 1, 1]
    half, level = 1, 0
    while half < size:
        groups = size // (2 * half)

        def grouped(x: jax.Array, groups: int = groups, half: int = half) -> jax.Array:
            return x.reshape(*x.shape[:-2], groups, 2 * half, dim)

        lower_rows = grouped(rows)[..., half:, :] * grouped(prefix[level])[..., half:, :]
        upper_columns = grouped(k)[..., :half, :] * grouped(suffix[level])[..., :half, :]
        quadrant = jnp.einsum("x...gik,...gjk->x...gij", lower_rows, upper_columns, precision=HIGHEST)
        blocks = _merge_blocks(blocks, quadrant)
        half, level = 2 * half, level + 1
    return blocks[0, ..., 0, :, :], blocks[1, ..., 0, :, :]


def _merge_blocks(
    blocks: jax.Array,  # [..., 2G, h, h] lower-triangular blocks along the diagonal
    quadrant: jax.Array,  # [..., G, h, h] the lower-left quadrant of each merged block
) -> jax.Array:
    """`[[top, 0], [quadrant, bottom]]` for each pair of consecutive blocks: [..., G, 2h, 2h]."""
    top, bottom = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
    upper = jnp.concatenate([top, jnp.zeros_like(top)], axis=-1)
    return jnp.concatenate([upper, jnp.concatenate([quadrant, bottom], axis=-1)], axis=-2)


# Up to this block size the inverse's quadrant products are element-wise sums, not matmuls: XLA:CPU
# spends a fixed cost per matrix on a batched dot of tiny matrices, several times the element-wise
# form's work.
ELEMENTWISE_INVERSE_MAX_HALF = 8


def unit_lower_inverse(a: jax.Array) -> jax.Array:  # a: [..., C, C] strictly lower triangular
    """(I + a)^-1 by recursive halving: inv([[L1, 0], [B, L2]]) = [[L1^-1, 0], [-L2^-1 B L1^-1, L2^-1]].

    Block forward substitution (as fla's solve_tril), in batched matmuls and, for blocks of up to
    `ELEMENTWISE_INVERSE_MAX_HALF` rows, element-wise products: no triangular_solve,
    which is slow for many small systems on CPU and absent from Pallas TPU. Returns [..., C, C].
    """
    *lead, size, _ = a.shape
    inverse = jnp.ones((*lead, size, 1, 1), a.dtype)  # the 1x1 diagonal blocks of I + a
    half = 1
    while half < size:
        groups = size // (2 * half)
        grouped = a.reshape(*lead, groups, 2 * half, groups, 2 * half)
        index = jnp.arange(groups)
        lower_left = jnp.moveaxis(grouped[..., index, half:, index, :half], 0, -3)  # [..., G, h, h]
        top, bottom = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        if half <= ELEMENTWISE_INVERSE_MAX_HALF:
            right = jnp.sum(lower_left[..., :, :, None] * top[..., None, :, :], axis=-2)
            quadrant = -jnp.sum(bottom[..., :, :, None] * right[..., None, :, :], axis=-2)
        else:
            quadrant = -jnp.einsum("...gij,...gjk,...gkl->...gil", bottom, lower_left, top, precision=HIGHEST)
        inverse = _merge_blocks(inverse, quadrant)
        half *= 2
    return inverse[..., 0, :, :]
