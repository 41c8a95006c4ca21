"""The plain-JAX decode steps the donated state buffer in place, a block of a request's heads at a time."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bench_decode import materialised_arrays
from kda_impl.kernels import naive
from kda_impl.kernels.decode import heads_per_step
from tests.kda_impl.kernel_inputs import random_kernel_inputs

BATCH, SLOTS, LAYERS, HEADS, DIM = 4, 9, 3, 2, 32
FP32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("layered", [False, True], ids=["one-layer", "pool-with-layer-index"])
def test_decode_neither_copies_the_buffer_nor_stores_the_batchs_states(layered):
    """Compiled with the buffer donated, decode stores no copy of the buffer and no array of the B states'
    size (a gather of the B states, or the stepped states waiting for a scatter)."""
    state = (HEADS, DIM, DIM)
    buffer_shape = (LAYERS, SLOTS, *state) if layered else (SLOTS, *state)

    def step(buffer, slots, layer, q, k, v, g, beta):
        return naive.decode_kda_slots(
            q, k, v, g, beta, state_buffer=buffer, slot_indices=slots, layer_index=layer if layered else None
        )

    f32 = jnp.float32
    token = jax.ShapeDtypeStruct((BATCH, HEADS, DIM), f32)
    args = (
        jax.ShapeDtypeStruct(buffer_shape, f32),
        jax.ShapeDtypeStruct((BATCH,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        *[token] * 4,
        jax.ShapeDtypeStruct((BATCH, HEADS), f32),
    )
    hlo = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    sizes = [(op, math.prod(shape)) for op, shape in materialised_arrays(hlo)]
    assert any(size == math.prod(buffer_shape) for _, size in sizes)  # the parser sees the buffer's updates
    assert ("copy", math.prod(buffer_shape)) not in sizes
    assert [(op, size) for op, size in sizes if size == BATCH * math.prod(state)] == []


def test_decode_in_head_blocks_matches_the_token_recurrence():
    """At a head shape whose states span several loop steps (8 heads of 128 x 128: two blocks of 4), each
    row's output and new state are the recurrence's (`fused_recurrent_kda`, one token), padding rows on
    the dummy slot included, and every other slot is left bit-identical."""
    heads, dim, slots = 8, 128, np.array([5, 0, 2, 0], np.int32)
    assert heads_per_step(heads, dim, dim) == 4
    rng = np.random.default_rng(11)
    inputs = random_kernel_inputs(rng, 1, heads=heads, dim=dim, batch=len(slots))
    buffer = (0.1 * rng.standard_normal((7, heads, dim, dim))).astype(np.float32)
    step = {name: x[:, 0] for name, x in inputs.items()}
    o, new_buffer = naive.decode_kda_slots(
        **step, state_buffer=buffer, slot_indices=slots, use_qk_l2norm_in_kernel=True
    )
    real = slots != 0
    expected_o, expected_states = naive.fused_recurrent_kda(
        **{name: x[real] for name, x in inputs.items()},
        initial_state=buffer[slots[real]],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    np.testing.assert_allclose(np.asarray(o)[real], np.asarray(expected_o)[:, 0], **FP32)
    np.testing.assert_allclose(np.asarray(new_buffer)[slots[real]], np.asarray(expected_states), **FP32)
    untouched = [1, 3, 4, 6]
    np.testing.assert_array_equal(np.asarray(new_buffer)[untouched], buffer[untouched])
