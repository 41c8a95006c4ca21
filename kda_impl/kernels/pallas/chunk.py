"""`chunk_kda` as a Pallas kernel: the chunked (WY) form of `kda_impl.kernels.chunk`, fused.

Reference: `kda_impl.kernels.reference_chunk.reference_chunk_kda` (the same equations in fla's names,
computed as written, in float64 in the tests); `kda_impl.kernels.chunk` derives the form.

Grid `(H, NC)`: heads in parallel, the chunks of the packed batch in order. Each step takes one chunk
of one head (`[C, K]` q, k, g, `[C, V]` v, `[C, 1]` beta), computes its state-independent part (decay
scores exact under strong decay, `(I + A)^-1` by blocked substitution), then applies it to the state
carried in VMEM scratch and writes the chunk's output. The state is reset from the sequence's initial
state at each sequence's first chunk and written to its final-state block after every chunk of it; the
initial and final blocks are chosen by the scalar-prefetched `seq` of each chunk, so a packed batch of
any lengths runs with shapes that depend only on (T, N).

Decays (no exponent ever overflows or is a difference of two long prefix sums, which loses ~eps*|prefix|
once strong decays precede weak ones): every exponent is a direct segment sum of g, a 0/1 mask matmul.
For the rows of a 16-row sub-block starting at row s, the columns before s factorise around s,
`exp(seg(s, i]) * exp(seg(j, s])`, both factors <= 1; the 16x16 diagonal blocks take the exact
element-wise `exp(seg(j, i])`, one block-local column at a time for all blocks together. (chunk.py
reaches the same values by recursive halving; the 16-row scheme keeps every in-kernel op 2-D.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kda_impl.kernels.common import PackedInputs, finite_log_decay, kda_gate
from kda_impl.kernels.entry import FlaResult, fla_entry
from kda_impl.kernels.options import GateArrays, validate_chunk_size
from kda_impl.kernels.pallas.common import (
    chunk_schedule,
    dot,
    dot_nt,
    heads_one_at_a_time_if_interpreted,
    masked_sum,
    resolve_interpret,
    to_chunks,
)
from kda_impl.kernels.pallas.tuning import CHUNK_SIZE, SUB_BLOCK


def _packed_chunk_kda(
    packed: PackedInputs,
    *,
    scale: float,
    chunk_size: int,
    gate: GateArrays | None,
    lower_bound: float | None,
    return_intermediate_states: bool,
    interpret: bool | None,
) -> tuple[jax.Array, ...]:
    """The kernel of `chunk_kda` on the packed batch (`entry.fla_entry`); its g is the raw gate with
    `gate` (A_log [HV], dt_bias [HV, K]), which the kernel applies. Any positive multiple of 16 as
    `chunk_size` (the public `chunk_kda` takes fla's 32 and 64)."""
    if chunk_size % SUB_BLOCK or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_BLOCK}, got {chunk_size}")
    heads, key_dim = packed.inputs.g.shape[1:]
    if gate is not None:
        gate = (gate[0].reshape(heads, 1, 1), gate[1].reshape(heads, 1, key_dim))
    return _chunk_packed(
        packed._replace(inputs=packed.inputs.scaled(scale)),
        gate,
        lower_bound=lower_bound,
        chunk_size=chunk_size,
        intermediate=return_intermediate_states,
        interpret=resolve_interpret(interpret),
    )


_CHUNK_KDA = fla_entry(
    _packed_chunk_kda,
    static=("chunk_size", "return_intermediate_states", "interpret"),
    gate_in_kernel=True,
    chunked=True,
)


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
    interpret: bool | None = None,
) -> FlaResult:
    """KDA over whole sequences, chunk by chunk (prefill), as one Pallas kernel.

    fla's calling convention: the arguments and the result of `kda_impl.kernels.entry`, then the
    kernel's own options. With `use_gate_in_kernel` the kernel computes the decay from the raw g
    (`-exp(A_log[h]) * softplus(g + dt_bias[h])`, or the lower-bound gate with `lower_bound`).

    Args:
        return_intermediate_states: also return h, the state entering every chunk (`entry`).
        chunk_size: tokens per chunk, 32 or 64 as in fla (default `tuning.CHUNK_SIZE`).
        interpret: run the kernel in interpret mode; default: unless the backend is TPU.
    """
    validate_chunk_size(chunk_size)
    return _CHUNK_KDA(**locals())  # every argument as written above


def _chunk_packed(
    packed: PackedInputs,  # q scaled; g the log decay, or the raw gate with `gate`
    gate: tuple[jax.Array, jax.Array] | None,  # A_log [H, 1, 1], dt_bias [H, 1, K]
    *,
    lower_bound: float | None,
    chunk_size: int,
    intermediate: bool,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """Lay the packed batch out in chunks, run the kernel, gather o back: `(o [T, H, V], finals)`, and
    with `intermediate` the state entering each chunk `[NC, H, K, V]`."""
    key_dim = packed.inputs.q.shape[-1]
    value_dim = packed.inputs.v.shape[-1]
    init = packed.init
    layout, schedule = chunk_schedule(packed.offsets(), packed.inputs.q.shape[0], chunk_size)
    qc, kc, vc, gc, bc = packed.inputs.map(lambda x: to_chunks(x, layout))
    num_chunks = qc.shape[0]

    def chunk_block(dim: int) -> pl.BlockSpec:  # [NC, H, C, dim] → one chunk of one head
        return pl.BlockSpec((None, None, chunk_size, dim), lambda h, c, *_: (c, h, 0, 0))

    state_block = pl.BlockSpec((None, None, key_dim, value_dim), lambda h, c, seq, *_: (seq[c], h, 0, 0))
    in_specs = [chunk_block(key_dim), chunk_block(key_dim), chunk_block(value_dim), chunk_block(key_dim)]
    in_specs += [chunk_block(1), state_block]
    inputs = [qc, kc, vc, gc, bc[..., None], init]
    head_axes = [1] * len(inputs)
    if gate is not None:
        in_specs += [
            pl.BlockSpec((None, 1, 1), lambda h, *_: (h, 0, 0)),
            pl.BlockSpec((None, 1, key_dim), lambda h, *_: (h, 0, 0)),
        ]
        inputs += list(gate)
        head_axes += [0, 0]
    out_specs = [chunk_block(value_dim), state_block]
    if intermediate:  # the state entering each chunk, one [K, V] block per (chunk, head)
        out_specs.append(pl.BlockSpec((None, None, key_dim, value_dim), lambda h, c, *_: (c, h, 0, 0)))

    def run(*inputs: jax.Array) -> list[jax.Array]:  # the operands above, on `heads` heads
        heads = inputs[0].shape[1]
        init = inputs[5]
        out_shape = [
            jax.ShapeDtypeStruct((num_chunks, heads, chunk_size, value_dim), jnp.float32),
            jax.ShapeDtypeStruct(init.shape, jnp.float32),
        ]
        if intermediate:
            out_shape.append(jax.ShapeDtypeStruct((num_chunks, heads, key_dim, value_dim), jnp.float32))
        return pl.pallas_call(
            functools.partial(
                _chunk_kernel,
                use_gate_in_kernel=gate is not None,
                lower_bound=lower_bound,
                intermediate=intermediate,
            ),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(schedule),
                grid=(heads, num_chunks),
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=[pltpu.VMEM((key_dim, value_dim), jnp.float32)],
            ),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            interpret=interpret,
        )(*schedule, *inputs)

    o_chunks, finals, *starts = heads_one_at_a_time_if_interpreted(
        run, inputs, head_axes, interpret=interpret
    )
    o = o_chunks[layout.slot, :, layout.row]  # [T, H, V]
    # A sequence of length zero owns no chunk: its final state is its initial one.
    return o, jnp.where(layout.nonempty[:, None, None, None], finals, init), *starts


def _chunk_kernel(
    # scalar prefetch
    seq_ref: jax.Array,  # i32[NC] sequence of each chunk (used by the index maps)
    first_ref: jax.Array,  # i32[NC] 1 at each sequence's first chunk
    rows_ref: jax.Array,  # i32[NC] valid rows of each chunk
    # inputs, outputs, scratch (the gate parameters after the inputs with `use_gate_in_kernel`, the
    # intermediate state after the outputs with `intermediate`):
    #   q, k, g [C, K]; v [C, V]; beta [C, 1]; init [K, V]; (A_log [1, 1], dt_bias [1, K]);
    #   o [C, V]; final [K, V]; (start [K, V]); state scratch [K, V]
    *refs: jax.Array,
    use_gate_in_kernel: bool,
    lower_bound: float | None,
    intermediate: bool,
) -> None:
    refs = list(refs)
    q_ref, k_ref, v_ref, g_ref, beta_ref, init_ref = refs[:6]
    a_log_ref, dt_bias_ref = refs[6:8] if use_gate_in_kernel else (None, None)
    o_ref, final_ref, *rest = refs[8 if use_gate_in_kernel else 6 :]
    start_ref, state_ref = rest if intermediate else (None, *rest)
    chunk = pl.program_id(1)

    @pl.when(first_ref[chunk] == 1)
    def _reset() -> None:
        state_ref[...] = init_ref[...]

    g = g_ref[...]
    if use_gate_in_kernel:  # padded rows must keep g = 0 so that they leave the state unchanged
        valid = jax.lax.broadcasted_iota(jnp.int32, (g.shape[0], 1), 0) < rows_ref[chunk]
        g = jnp.where(valid, kda_gate(g, a_log_ref[...], dt_bias_ref[...], lower_bound), 0.0)
    g = finite_log_decay(g)  # g = -inf (a full reset) would make the mask matmuls 0 * -inf = NaN
    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]

    prefix, to_end, from_block_start = _segment_sums(g)
    aqk, kk = _decay_scores(q, k, g, from_block_start)  # Aqk, and Akk before its beta
    gamma = jnp.exp(prefix)  # Γ <= 1
    akk_inverse = _unit_lower_inverse(kk * beta)  # (I + Akk)^-1
    u = dot(akk_inverse, v * beta)
    w = dot(akk_inverse, k * gamma * beta)
    start = state_ref[...]
    if intermediate:
        start_ref[...] = start
    v_new = u - dot(w, start)  # [C, V]
    o_ref[...] = dot(q * gamma, start) + dot(aqk, v_new)
    chunk_decay = gamma.T[:, -1:]  # [K, 1] Γ_C, the decay of the whole chunk per key channel
    kg = k * jnp.exp(to_end)  # k decayed to the chunk end
    end = chunk_decay * start + dot(kg.T, v_new)
    state_ref[...] = end

    @pl.when(rows_ref[chunk] > 0)  # the unused chunks at the end write nothing
    def _write_final() -> None:
        final_ref[...] = end


def _iotas(size: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of a `[size, size]` matrix."""
    return (
        jax.lax.broadcasted_iota(jnp.int32, (size, size), 0),
        jax.lax.broadcasted_iota(jnp.int32, (size, size), 1),
    )


def _block_of(index: jax.Array) -> jax.Array:
    """The 16-row block of each row index (a shift: Mosaic's integer division needs a TPU to lower)."""
    return jax.lax.shift_right_logical(index, SUB_BLOCK.bit_length() - 1)


def _in_block(index: jax.Array) -> jax.Array:
    """Each row index's position inside its 16-row block."""
    return jax.lax.bitwise_and(index, SUB_BLOCK - 1)


def _segment_sums(g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # g: [C, K]
    """`(prefix, to_end, from_block_start)`, each `[C, K]`: for row i with s its 16-row block's first row,
    seg(-1, i], seg(i, C-1] and seg(s, i] (seg(a, b] = sum of g over rows a+1..b), summed directly."""
    i, t = _iotas(g.shape[0])
    same_block = _block_of(i) == _block_of(t)
    prefix = masked_sum(t <= i, g)
    to_end = masked_sum(t > i, g)
    from_block_start = masked_sum(same_block & (_in_block(t) > 0) & (t <= i), g)
    return prefix, to_end, from_block_start


def _decay_scores(
    q: jax.Array,  # [C, K] scaled
    k: jax.Array,  # [C, K]
    g: jax.Array,  # [C, K]
    from_block_start: jax.Array,  # [C, K] seg(s, i]
) -> tuple[jax.Array, jax.Array]:
    """qk[i, j] (j <= i) and kk[i, j] (j < i) of `sum_d x_i[d] k_j[d] exp(seg(j, i][d])`, `[C, C]` each.

    Columns before row i's 16-row block: `exp(seg(s, i]) * exp(seg(j, s])`, both <= 1. Inside the block:
    the exact `exp(seg(j, i])`, one block-local column j at a time for all blocks together.
    """
    size = q.shape[0]
    i, t = _iotas(size)
    block_of_row = _block_of(i)
    row_decay = jnp.exp(from_block_start)
    q_rows, k_rows = q * row_decay, k * row_decay
    off_qk = off_kk = jnp.zeros((size, size), jnp.float32)
    for block in range(1, size // SUB_BLOCK):
        start = block * SUB_BLOCK
        columns = k * jnp.exp(masked_sum((t > i) & (t <= start), g))  # k_j exp(seg(j, s]); j >= s unused
        earlier = (block_of_row == block) & (t < start)
        off_qk += jnp.where(earlier, dot_nt(q_rows, columns), 0.0)
        off_kk += jnp.where(earlier, dot_nt(k_rows, columns), 0.0)

    row = jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    block_start = row - _in_block(row)  # [C, 1]

    def block_column(local: jax.Array, scores: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        diag_qk, diag_kk = scores
        column = block_start + local  # [C, 1] the column of row i's block this step fills
        pair = masked_sum((block_of_row == _block_of(t)) & (t > column) & (t <= i), g)  # seg(column, i]
        k_column = masked_sum(t == column, k)  # k[column] on every row (a one-hot, exact)
        decayed = jnp.where(row >= column, k_column * jnp.exp(pair), 0.0)
        at = t == column
        diag_qk = jnp.where(at, jnp.sum(q * decayed, axis=1, keepdims=True), diag_qk)
        diag_kk = jnp.where(at & (i > t), jnp.sum(k * decayed, axis=1, keepdims=True), diag_kk)
        return diag_qk, diag_kk

    zeros = jnp.zeros((size, size), jnp.float32)
    diag_qk, diag_kk = jax.lax.fori_loop(0, SUB_BLOCK, block_column, (zeros, zeros))
    return off_qk + diag_qk, off_kk + diag_kk


def _unit_lower_inverse(a: jax.Array) -> jax.Array:  # a: [C, C] strictly lower triangular
    """`(I + a)^-1` at fp32 accuracy, by substitution (Pallas TPU has no triangular_solve).

    The 16x16 diagonal blocks D first: `X <- I - a_D X` fixes one more row of every block per step, so 15
    steps are forward substitution. Then the blocks below: with P = D^-1 a_off, `Y <- D^-1 - P Y` fixes
    one more block row per step (block forward substitution, as fla's solve_tril merges its blocks).
    """
    size = a.shape[0]
    i, t = _iotas(size)
    same_block = _block_of(i) == _block_of(t)
    eye = (i == t).astype(jnp.float32)
    within = jnp.where(same_block, a, 0.0)
    inv_diag = jax.lax.fori_loop(0, SUB_BLOCK - 1, lambda _, x: eye - dot(within, x), eye)
    across = dot(inv_diag, jnp.where(same_block, 0.0, a))
    blocks = size // SUB_BLOCK
    return jax.lax.fori_loop(0, blocks - 1, lambda _, y: inv_diag - dot(across, y), inv_diag)
