"""`fused_recurrent_kda` as a Pallas kernel: the KDA recurrence token by token, state in VMEM.

Reference: `kda_impl.kernels.naive_recurrent.fused_recurrent_kda`, whose step `column_step` follows line
for line.

B requests × T tokens and packed batches (`cu_seqlens`) run the same way: every sequence is cut into its
own zero-padded blocks of `RECURRENT_TOKENS_PER_STEP` tokens (chunk.py's chunk layout; a padded token
has k = g = beta = 0 and leaves the state unchanged). Grid `(H, NC)`: heads in parallel, blocks in order;
each step loops over its tokens with the state in VMEM scratch, reset from the sequence's initial state
at its first block and written to its final-state block after each block, both chosen through the
scalar-prefetched `seq` of the block. Per token, q, k, g and beta come as the columns of a `[K, 4]`
block and v as a `[1, V]` row, so every op is a lane broadcast or a sublane reduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_impl.kernels.chunk import _to_chunks
from kda_impl.kernels.common import initial_or_zeros, prepare_inputs
from kda_impl.kernels.pallas.common import (
    COLUMNS,
    chunk_schedule,
    column_step,
    pack_columns,
    resolve_interpret,
)
from kda_impl.kernels.pallas.tuning import RECURRENT_TOKENS_PER_STEP
from kda_impl.kernels.validation import static_validate_inputs


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
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    r"""KDA as a token recurrence (decode and short prefill), as one Pallas kernel.

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
        interpret: run the kernel in interpret mode; default: unless the backend is TPU.

    Returns:
        `(o, final_state)`: o `[B, T, H, V]` in q's dtype, final_state `[N, H, K, V]` fp32 or None.
    """
    shapes = static_validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    init = initial_or_zeros(initial_state, shapes.state_shape)
    batch, tokens = shapes.batch, shapes.tokens
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(batch + 1, dtype=jnp.int32) * tokens
    flat = [x.reshape(batch * tokens, *x.shape[2:]) for x in (q * scale, k, v, g, beta)]
    o, final = _recurrent_packed(
        *flat, init, jnp.asarray(cu_seqlens, jnp.int32), interpret=resolve_interpret(interpret)
    )
    o = o.reshape(batch, tokens, shapes.heads, shapes.value_dim)
    return o.astype(out_dtype), (final if output_final_state else None)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _recurrent_packed(
    q: jax.Array,  # [T, H, K] fp32, scaled
    k: jax.Array,  # [T, H, K]
    v: jax.Array,  # [T, H, V]
    g: jax.Array,  # [T, H, K]
    beta: jax.Array,  # [T, H]
    init: jax.Array,  # [N, H, K, V] fp32
    cu_seqlens: jax.Array,  # i32[N + 1]
    *,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """Lay the packed batch out in token blocks, run the kernel, gather o back: `(o [T, H, V], finals)`."""
    heads, key_dim = q.shape[1:]
    value_dim = v.shape[-1]
    block = RECURRENT_TOKENS_PER_STEP
    layout, schedule = chunk_schedule(cu_seqlens, q.shape[0], block)
    qc, kc, vc, gc, bc = (_to_chunks(x, layout) for x in (q, k, v, g, beta))
    columns = pack_columns(qc, kc, gc, bc)  # [NC, H, block, K, 4]
    num_blocks = columns.shape[0]

    row_block = pl.BlockSpec((None, None, block, 1, value_dim), lambda h, c, *_: (c, h, 0, 0, 0))
    state_block = pl.BlockSpec((None, None, key_dim, value_dim), lambda h, c, seq, *_: (seq[c], h, 0, 0))
    o_blocks, finals = pl.pallas_call(
        _recurrent_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(schedule),
            grid=(heads, num_blocks),
            in_specs=[
                pl.BlockSpec((None, None, block, key_dim, COLUMNS), lambda h, c, *_: (c, h, 0, 0, 0)),
                row_block,
                state_block,
            ],
            out_specs=[row_block, state_block],
            scratch_shapes=[pltpu.VMEM((key_dim, value_dim), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((num_blocks, heads, block, 1, value_dim), jnp.float32),
            jax.ShapeDtypeStruct(init.shape, jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(*schedule, columns, vc[:, :, :, None, :], init)
    o = o_blocks[layout.slot, :, layout.row, 0]  # [T, H, V]
    # A sequence of length zero owns no block: its final state is its initial one.
    return o, jnp.where(layout.nonempty[:, None, None, None], finals, init)


def _recurrent_kernel(
    # scalar prefetch
    seq_ref: jax.Array,  # i32[NC] sequence of each token block (used by the index maps)
    first_ref: jax.Array,  # i32[NC] 1 at each sequence's first block
    rows_ref: jax.Array,  # i32[NC] valid tokens of each block
    # inputs
    columns_ref: jax.Array,  # [block, K, 4] q, k, g, beta per token
    v_ref: jax.Array,  # [block, 1, V]
    init_ref: jax.Array,  # [K, V]
    # outputs
    o_ref: jax.Array,  # [block, 1, V]
    final_ref: jax.Array,  # [K, V]
    # scratch
    state_ref: jax.Array,  # [K, V] fp32, carried across the blocks of a sequence
) -> None:
    step = pl.program_id(1)

    @pl.when(first_ref[step] == 1)
    def _reset() -> None:
        state_ref[...] = init_ref[...]

    def token(t: jax.Array, state: jax.Array) -> jax.Array:
        state, o = column_step(state, columns_ref[t], v_ref[t])
        o_ref[t] = o
        return state

    end = jax.lax.fori_loop(0, columns_ref.shape[0], token, state_ref[...])
    state_ref[...] = end

    @pl.when(rows_ref[step] > 0)  # the unused blocks at the end write nothing
    def _write_final() -> None:
        final_ref[...] = end
