"""`fused_recurrent_kda` as a Pallas kernel: the KDA recurrence token by token, state in VMEM.

Reference: `kda_impl.kernels.recurrent.fused_recurrent_kda`, whose step `column_step` follows line
for line.

B requests × T tokens and packed batches (`cu_seqlens`) run the same way: every sequence is cut into its
own zero-padded blocks of `RECURRENT_TOKENS_PER_STEP` tokens (`common.chunk_layout`; a padded token
has k = g = beta = 0 and leaves the state unchanged). Grid `(H, NC)`: heads in parallel, blocks in order;
each step loops over its tokens with the state in VMEM scratch, reset from the sequence's initial state
at its first block and written to its final-state block after each block, both chosen through the
scalar-prefetched `seq` of the block. Per token, q, k, g and beta come as the columns of a `[K, 4]`
block and v as a `[1, V]` row, so every op is a lane broadcast or a sublane reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_impl.kernels.common import PackedInputs
from kda_impl.kernels.entry import FlaResult, fla_entry
from kda_impl.kernels.pallas.common import (
    COLUMNS,
    chunk_schedule,
    column_step,
    heads_one_at_a_time_if_interpreted,
    pack_columns,
    resolve_interpret,
    to_chunks,
)
from kda_impl.kernels.pallas.tuning import RECURRENT_TOKENS_PER_STEP


def _packed_fused_recurrent_kda(
    packed: PackedInputs, *, scale: float, interpret: bool | None
) -> tuple[jax.Array, jax.Array]:
    """The kernel of `fused_recurrent_kda` on the packed batch (`entry.fla_entry`): lay it out in token
    blocks, run the kernel, gather o back: `(o [T, H, V], finals)`."""
    key_dim = packed.inputs.q.shape[-1]
    value_dim = packed.inputs.v.shape[-1]
    init = packed.init
    block = RECURRENT_TOKENS_PER_STEP
    layout, schedule = chunk_schedule(packed.offsets(), packed.inputs.q.shape[0], block)
    qc, kc, vc, gc, bc = packed.inputs.scaled(scale).map(lambda x: to_chunks(x, layout))
    columns = pack_columns(qc, kc, gc, bc)  # [NC, H, block, K, 4]
    num_blocks = columns.shape[0]
    interpret = resolve_interpret(interpret)

    row_block = pl.BlockSpec((None, None, block, 1, value_dim), lambda h, c, *_: (c, h, 0, 0, 0))
    state_block = pl.BlockSpec((None, None, key_dim, value_dim), lambda h, c, seq, *_: (seq[c], h, 0, 0))

    def run(columns: jax.Array, v_rows: jax.Array, init: jax.Array) -> list[jax.Array]:
        heads = columns.shape[1]
        return pl.pallas_call(
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
        )(*schedule, columns, v_rows, init)

    o_blocks, finals = heads_one_at_a_time_if_interpreted(
        run, [columns, vc[:, :, :, None, :], init], [1, 1, 1], interpret=interpret
    )
    o = o_blocks[layout.slot, :, layout.row, 0]  # [T, H, V]
    # A sequence of length zero owns no block: its final state is its initial one.
    return o, jnp.where(layout.nonempty[:, None, None, None], finals, init)


_FUSED_RECURRENT_KDA = fla_entry(_packed_fused_recurrent_kda, static=("interpret",))


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
    interpret: bool | None = None,
) -> FlaResult:
    """KDA as a token recurrence (decode and short prefill), as one Pallas kernel.

    fla's calling convention: the arguments and the result of `kda_impl.kernels.entry`, then the
    kernel's own options.

    Args:
        interpret: run the kernel in interpret mode; default: unless the backend is TPU.
    """
    return _FUSED_RECURRENT_KDA(**locals())  # every argument as written above


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
