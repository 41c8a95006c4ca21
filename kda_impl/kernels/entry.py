"""The one wrapper of the KDA prefill kernels: fla's calling convention around a kernel on packed tokens.

`chunk_kda` and `fused_recurrent_kda`, plain JAX and Pallas, are each written with fla's signature (the
arguments below, then the kernel's own options) and call their kernel on the prepared packed batch
(fp32, `[B * T, HV, ...]`) through `fla_entry`, which does the rest once for all four: it checks the
arguments (`options.fla_options`), makes the zero initial states, and in one jitted program upcasts (and
l2-normalises) the inputs, applies fla's options (`options.apply_options`: beta's sigmoid, GVA, the gate),
puts the states in the kernels' `[K, V]` layout, flattens the B rows into one packed batch, calls the
kernel, and reshapes its output back to `[B, T, HV, V]` in q's dtype.

Args (of every entry point):
    q: queries `[B, T, H, K]`.
    k: keys `[B, T, H, K]`.
    v: values `[B, T, HV, V]`; HV a multiple of H (GVA, see `options`).
    g: per-channel log decay (<= 0) `[B, T, HV, K]`, or the gate's input with `use_gate_in_kernel`.
    beta: write strengths `[B, T, HV]`, or their logits with `use_beta_sigmoid_in_kernel`.
    scale: query scale, default `K ** -0.5`.
    initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), N = B, or the number of
        sequences with `cu_seqlens`.
    output_final_state: return the final state of every sequence.
    cu_seqlens: `i32[N + 1]` offsets of a packed batch (then B must be 1).
    use_qk_l2norm_in_kernel: l2-normalise q and k (fp32) first.
    use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, state_v_first, transpose_state_layout: fla's options, see `kda_impl.kernels.options`.

Returns:
    `(o, final_state)`: o `[B, T, HV, V]` in q's dtype, final_state `[N, HV, K, V]` (or `[N, HV, V, K]`)
    fp32 or None. A chunk kernel with `return_intermediate_states=True` returns `(o, final_state, h)`, h
    the state entering every chunk, as fla: `[B, NT, HV, K, V]` (`[..., V, K]` with `state_v_first`) in
    k's dtype, NT = ceil(T / chunk_size) per row; with `cu_seqlens` B = 1 and NT the chunks of all
    sequences (sum of ceil(T_i / chunk_size); under `jit`, where the lengths are not known, the static
    bound (T + N (chunk_size - 1)) // chunk_size, its unused last chunks unspecified).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.common import KdaInputs, PackedInputs, initial_or_zeros, prepare_inputs
from kda_impl.kernels.options import FlaOptions, apply_options, fla_options, swap_state_layout
from kda_impl.kernels.validation import KernelShapes, static_validate_inputs

FlaResult = tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]
FLA_ARGUMENTS = (
    "use_gate_in_kernel",
    "A_log",
    "dt_bias",
    "safe_gate",
    "lower_bound",
    "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval",
    "state_v_first",
    "transpose_state_layout",
)


def fla_entry(
    kernel: Callable,
    *,
    static: tuple[str, ...] = (),
    gate_in_kernel: bool = False,
    chunked: bool = False,
) -> Callable[..., FlaResult]:
    """`kernel` called in fla's convention (see the module docstring): the returned function takes q, k,
    v, g, beta, the keyword arguments of the module docstring and the kernel's options, and returns
    `(o, final_state)` (or `(o, final_state, h)`).

    `kernel(packed, *, scale, **options) -> (o, final)`: `packed` the call's `common.PackedInputs`:
    inputs `[B * T, HV, ...]` fp32, q unscaled and l2-normalised if asked, beta activated, q and k on
    the HV heads, g the log decay; init `[N, HV, K, V]` fp32; cu_seqlens `i32[N + 1]`, or None for a batch
    of B = N rows of equal length. `scale` is the resolved float. It returns o `[B * T, HV, V]` and the
    final states `[N, HV, K, V]`, and runs traced, inside the jit: `static` names its options that are
    compile-time values (the others are arrays, or None).

    gate_in_kernel: the kernel applies the gate itself: g stays the raw gate, and the kernel gets
        `gate` (`options.GateArrays` or None) and `lower_bound`.
    chunked: a chunk kernel, whose options hold `chunk_size`: it gets `return_intermediate_states` and
        then returns `(o, final, states)`, states `[NC, HV, K, V]` the state entering each chunk of
        `common.chunk_layout` (its unused last chunks anything).
    """

    def run(inputs, init, cu_seqlens, gate, arrays, *, scale, fla: FlaOptions, options):
        batch, tokens = inputs.q.shape[:2]
        *prepared, scale = prepare_inputs(*inputs, scale, fla.use_qk_l2norm_in_kernel)
        prepared = apply_options(KdaInputs(*prepared), gate, fla, gate_in_kernel=gate_in_kernel)
        packed = prepared.map(lambda x: x.reshape(batch * tokens, *x.shape[2:]))
        if fla.state_v_first:
            init = swap_state_layout(init)
        options = dict(options)
        if gate_in_kernel:
            options.update(gate=gate, lower_bound=fla.lower_bound)
        o, final, *states = kernel(PackedInputs(packed, init, cu_seqlens), scale=scale, **arrays, **options)
        if fla.state_v_first:
            final, states = swap_state_layout(final), [swap_state_layout(s) for s in states]
        o = o.reshape(batch, tokens, *o.shape[1:]).astype(inputs.q.dtype)
        return o, final, *(s.astype(inputs.k.dtype) for s in states)

    jitted = jax.jit(run, static_argnames=("scale", "fla", "options"))

    def entry(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        *,
        scale: float | None,
        initial_state: jax.Array | None,
        output_final_state: bool,
        cu_seqlens: jax.Array | None,
        use_qk_l2norm_in_kernel: bool,
        **options: object,
    ) -> FlaResult:
        fla, gate = fla_options(
            g_shape=np.shape(g),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            **{name: options.pop(name) for name in FLA_ARGUMENTS if name in options},
        )
        inputs = KdaInputs(q, k, v, g, beta)
        shapes = static_validate_inputs(inputs, initial_state, cu_seqlens, fla.state_v_first)
        # The zeros are made here, not under jit: calls with and without initial states share a program.
        init = initial_or_zeros(initial_state, shapes.state_shape)
        if cu_seqlens is not None:
            cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        intermediate = bool(options.pop("return_intermediate_states", False)) if chunked else False
        if chunked:
            options["return_intermediate_states"] = intermediate
        arrays = {name: value for name, value in options.items() if name not in static}
        compile_time = tuple(sorted((name, value) for name, value in options.items() if name in static))
        o, final, *states = jitted(
            inputs, init, cu_seqlens, gate, arrays, scale=scale, fla=fla, options=compile_time
        )
        final = final if output_final_state else None
        if not intermediate:
            return o, final
        return o, final, chunk_states(states[0], shapes, cu_seqlens, int(options["chunk_size"]))

    return entry


def chunk_states(
    states: jax.Array,  # [NC, HV, ...] the state entering each chunk of `common.chunk_layout`
    shapes: KernelShapes,
    cu_seqlens: jax.Array | None,  # i32[N + 1]
    chunk_size: int,
) -> jax.Array:
    """fla's intermediate states h: `[B, NT, HV, ...]`, NT = ceil(T / C) per row; with `cu_seqlens`,
    `[1, NT, HV, ...]` with NT the chunks of all sequences (the static bound under `jit`)."""
    if cu_seqlens is None:
        per_row = -(-shapes.tokens // chunk_size)
        return states[: shapes.batch * per_row].reshape(shapes.batch, per_row, *states.shape[1:])
    if isinstance(cu_seqlens, jax.core.Tracer):
        return states[None]
    lengths = np.diff(np.asarray(cu_seqlens))
    return states[None, : int(np.sum(-(-lengths // chunk_size)))]
