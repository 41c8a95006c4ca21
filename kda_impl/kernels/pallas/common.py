"""Pieces shared by the Pallas KDA kernels: interpret-mode choice and its head-by-head runs, fp32 dots,
the column layout of one token, the packed batch cut into chunks and the per-chunk schedule read through
scalar prefetch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import HIGHEST, ChunkLayout, chunk_layout

COLUMNS = 4  # q, k, g, beta of one token as the columns of a [K, 4] block (see `pack_columns`)


def resolve_interpret(interpret: bool | None) -> bool:
    """Interpret mode unless running on TPU, where the kernels compile with Mosaic."""
    if interpret is None:
        return jax.default_backend() != "tpu"
    return interpret


def heads_one_at_a_time_if_interpreted(
    run: Callable[..., list[jax.Array]],
    operands: Sequence[jax.Array],
    head_axes: Sequence[int],
    *,
    interpret: bool,
) -> list[jax.Array]:
    """`run(*operands)`, a kernel over independent heads whose outputs have their head axis at 1; in
    interpret mode, one head at a time.

    Pallas' interpreter carries every operand through a loop over the grid, and XLA on a CPU copies each
    whole operand at every grid step, so a step costs time in proportion to the operands' size (the
    measurement is in docs/kernels.md). The heads are a `parallel` grid axis: run on each head's slice
    of the operands (`head_axes[i]` is operand i's head axis), the kernel gives the same outputs and a
    step costs one head's copies. Compiled (a TPU), `run` runs once, on every head.
    """
    if not interpret:
        return run(*operands)

    def one_head(slices: list[jax.Array]) -> list[jax.Array]:
        return run(*(jnp.expand_dims(x, axis) for x, axis in zip(slices, head_axes, strict=True)))

    heads_first = [jnp.moveaxis(x, axis, 0) for x, axis in zip(operands, head_axes, strict=True)]
    per_head = jax.lax.map(one_head, heads_first)  # each [H, d0, 1, ...]
    return [jnp.moveaxis(y[:, :, 0], 0, 1) for y in per_head]


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` accumulated in fp32 at full precision."""
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b.T` (contracting the last dims) accumulated in fp32 at full precision."""
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32
    )


def masked_sum(mask: jax.Array, x: jax.Array) -> jax.Array:
    """`sum_t mask[i, t] x[t]`: a direct sum over the rows the 0/1 mask selects (exact weights)."""
    return dot(mask.astype(jnp.float32), x)


def pack_columns(
    q: jax.Array,  # [..., K] scaled queries
    k: jax.Array,  # [..., K]
    g: jax.Array,  # [..., K]
    beta: jax.Array,  # [...]
) -> jax.Array:
    """`[..., K, 4]`: each token's q, k, g and beta (repeated down K) as columns.

    The recurrence scales rows of the `[K, V]` state by k and exp(g), so the kernels need them with K on
    sublanes; handing them over as columns keeps every in-kernel op a lane broadcast or a sublane reduce.
    """
    beta_column = jnp.broadcast_to(beta[..., None], k.shape)
    return jnp.stack([q, k, g, beta_column], axis=-1)


def column_step(
    state: jax.Array,  # [..., K, V] fp32
    columns: jax.Array,  # [..., K, 4] q (scaled), k, g, beta per `pack_columns`
    v: jax.Array,  # [..., 1, V]
) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence (recurrent.recurrent_step), exact fp32 element-wise sums.

    Returns (new state [..., K, V], o [..., 1, V]).
    """
    q, k, g = columns[..., 0:1], columns[..., 1:2], columns[..., 2:3]
    beta = columns[..., 0:1, 3:4]
    state = state * jnp.exp(g)
    predicted = jnp.sum(k * state, axis=-2, keepdims=True)
    state = state + k * (beta * (v - predicted))
    return state, jnp.sum(q * state, axis=-2, keepdims=True)


def pack_rows(
    q: jax.Array,  # [..., K] scaled queries
    k: jax.Array,  # [..., K]
    g: jax.Array,  # [..., K]
    beta: jax.Array,  # [...]
) -> jax.Array:
    """`[..., 4, K]`: each token's q, k, g and beta (repeated along K) as rows, for a v-first `[V, K]`
    state (`row_step`), whose rows are scaled by k and exp(g) along the lanes."""
    return jnp.swapaxes(pack_columns(q, k, g, beta), -1, -2)


def row_step(
    state: jax.Array,  # [..., V, K] fp32, v-first
    rows: jax.Array,  # [..., 4, K] q (scaled), k, g, beta per `pack_rows`
    v: jax.Array,  # [..., V, 1]
) -> tuple[jax.Array, jax.Array]:
    """`column_step` on a v-first state: the same recurrence with K on lanes. Returns (new state
    [..., V, K], o [..., V, 1])."""
    q, k, g = rows[..., 0:1, :], rows[..., 1:2, :], rows[..., 2:3, :]
    beta = rows[..., 3:4, 0:1]
    state = state * jnp.exp(g)
    predicted = jnp.sum(k * state, axis=-1, keepdims=True)
    state = state + (beta * (v - predicted)) * k
    return state, jnp.sum(q * state, axis=-1, keepdims=True)


def chunk_schedule(
    cu_seqlens: jax.Array,  # i32[N + 1]
    tokens: int,
    chunk_size: int,
) -> tuple[ChunkLayout, tuple[jax.Array, jax.Array, jax.Array]]:
    """The chunk layout of a packed batch and the kernels' scalar-prefetch schedule.

    Schedule, one entry per chunk: `seq` i32[NC] the sequence it belongs to (its initial / final state
    block), `first` i32[NC] 1 where it starts its sequence (the state is reset), `rows` i32[NC] its
    valid tokens (0 for the unused chunks at the end).
    """
    layout = chunk_layout(cu_seqlens, tokens, chunk_size)
    rows = jnp.sum(layout.valid, axis=1, dtype=jnp.int32)
    return layout, (layout.seq, layout.is_first.astype(jnp.int32), rows)


def to_chunks(x: jax.Array, layout: ChunkLayout) -> jax.Array:
    """[T, H, ...] packed → [NC, H, C, ...] chunked, zeros in padded rows."""
    gathered = x[layout.token]  # [NC, C, H, ...]
    mask = layout.valid.reshape(layout.valid.shape + (1,) * (x.ndim - 1))
    return jnp.moveaxis(jnp.where(mask, gathered, 0), 2, 1)
