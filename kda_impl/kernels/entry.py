"""The one wrapper of the KDA prefill kernels: fla's calling convention around a kernel on packed tokens.

`chunk_kda` and `fused_recurrent_kda`, plain JAX and Pallas, are each written with fla's signature (the
arguments below, then the kernel's own options) and call their kernel on the prepared packed batch
(fp32, `[B * T, H, ...]`) through `fla_entry`, which does the rest once for all four: it checks the
arguments, makes the zero initial states, and in one jitted program upcasts (and l2-normalises) the
inputs, flattens the B rows into one packed batch, calls the kernel, and reshapes its output back to
`[B, T, H, V]` in q's dtype.

Args (of every entry point):
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

Returns:
    `(o, final_state)`: o `[B, T, H, V]` in q's dtype, final_state `[N, H, K, V]` fp32 or None.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import KdaInputs, PackedInputs, initial_or_zeros, prepare_inputs
from kda_impl.kernels.validation import static_validate_inputs

FlaResult = tuple[jax.Array, jax.Array | None]


def fla_entry(kernel: Callable, *, static: tuple[str, ...] = ()) -> Callable[..., FlaResult]:
    """`kernel` called in fla's convention (see the module docstring): the returned function takes q, k,
    v, g, beta, the keyword arguments of the module docstring and the kernel's options, and returns
    `(o, final_state)`.

    `kernel(packed, *, scale, **options) -> (o, final)`: `packed` the call's `common.PackedInputs`:
    inputs `[B * T, H, ...]` fp32, q unscaled and l2-normalised if asked; init `[N, H, K, V]` fp32;
    cu_seqlens `i32[N + 1]`, or None for a batch of B = N rows of equal length. `scale` is the resolved
    float. It returns o `[B * T, H, V]` and the final states `[N, H, K, V]`, and runs traced, inside the
    jit: `static` names its options that are compile-time values (the others are arrays, or None).
    """

    def run(inputs, init, cu_seqlens, arrays, *, scale, use_qk_l2norm_in_kernel, options):
        batch, tokens = inputs.q.shape[:2]
        *prepared, scale = prepare_inputs(*inputs, scale, use_qk_l2norm_in_kernel)
        packed = KdaInputs(*prepared).map(lambda x: x.reshape(batch * tokens, *x.shape[2:]))
        o, final = kernel(PackedInputs(packed, init, cu_seqlens), scale=scale, **arrays, **dict(options))
        return o.reshape(batch, tokens, *o.shape[1:]).astype(inputs.q.dtype), final

    jitted = jax.jit(run, static_argnames=("scale", "use_qk_l2norm_in_kernel", "options"))

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
        inputs = KdaInputs(q, k, v, g, beta)
        shapes = static_validate_inputs(inputs, initial_state, cu_seqlens)
        # The zeros are made here, not under jit: calls with and without initial states share a program.
        init = initial_or_zeros(initial_state, shapes.state_shape)
        if cu_seqlens is not None:
            cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        arrays = {name: value for name, value in options.items() if name not in static}
        compile_time = tuple(sorted((name, value) for name, value in options.items() if name in static))
        o, final = jitted(
            inputs,
            init,
            cu_seqlens,
            arrays,
            scale=scale,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            options=compile_time,
        )
        return o, (final if output_final_state else None)

    return entry
