"""The plain-JAX kernels against fla-core's torch references, on fresh seeded inputs each run."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.kernels import naive
from tests.kda_impl.kernel_inputs import fla_reference, fresh_rng, random_kernel_inputs, run_kernel

pytest.importorskip("torch")
pytest.importorskip("fla.ops.kda.naive")

pytestmark = pytest.mark.torch
FP32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def rng(request) -> np.random.Generator:
    return fresh_rng(request)


KERNELS = {"chunk": naive.chunk_kda, "recurrent": naive.fused_recurrent_kda}


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_matches_fla_naive(rng, kernel, tokens, with_state):
    inputs = random_kernel_inputs(rng, tokens, batch=2)
    h0 = rng.standard_normal((2, 2, 32, 32)).astype(np.float32) if with_state else None
    o, state = run_kernel(KERNELS[kernel], inputs, initial_state=h0)
    for chunked in (False, True):
        ref_o, ref_state = fla_reference(inputs, h0, chunked=chunked)
        np.testing.assert_allclose(o, ref_o, **FP32)
        np.testing.assert_allclose(state, ref_state, **FP32)


@pytest.mark.parametrize("decay", ["strong", "mixed"])
@pytest.mark.parametrize("tokens", [65, 200])
def test_chunk_exact_under_strong_decay(rng, decay, tokens):
    """g down to -60 per token: the factorised form would overflow; results stay finite and exact."""
    inputs = random_kernel_inputs(rng, tokens, decay=decay)
    h0 = rng.standard_normal((1, 2, 32, 32)).astype(np.float32)
    o, state = run_kernel(naive.chunk_kda, inputs, initial_state=h0)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state))
    ref_o, ref_state = fla_reference(inputs, h0)
    np.testing.assert_allclose(o, ref_o, **FP32)
    np.testing.assert_allclose(state, ref_state, **FP32)


def test_head_dim_128_long_sequence(rng):
    """The real head size over a long sequence: chunk == fla naive recurrent, state included."""
    inputs = random_kernel_inputs(rng, 1000, heads=2, dim=128)
    o, state = run_kernel(naive.chunk_kda, inputs)
    ref_o, ref_state = fla_reference(inputs, None)
    np.testing.assert_allclose(o, ref_o, **FP32)
    np.testing.assert_allclose(state, ref_state, **FP32)


@pytest.mark.parametrize("lengths", [[5, 17, 1, 41], [64, 1, 65], [3, 0, 70, 0]])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_packed_batch_matches_each_sequence_alone(rng, kernel, lengths):
    """Sequences of a packed batch never leak into each other; zero-length ones keep their state."""
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = random_kernel_inputs(rng, int(cu_seqlens[-1]))
    h0 = rng.standard_normal((len(lengths), 2, 32, 32)).astype(np.float32)
    o, state = run_kernel(KERNELS[kernel], inputs, initial_state=h0, cu_seqlens=cu_seqlens)
    for i, (start, end) in enumerate(itertools.pairwise(cu_seqlens)):
        if start == end:
            np.testing.assert_array_equal(state[i], h0[i])
            continue
        alone = {name: x[:, start:end] for name, x in inputs.items()}
        ref_o, ref_state = fla_reference(alone, h0[i : i + 1])
        np.testing.assert_allclose(o[:, start:end], ref_o, **FP32)
        np.testing.assert_allclose(state[i], ref_state[0], **FP32)


def test_padded_tail_leaves_state_untouched(rng):
    """A sequence ending 1 token into a chunk carries the same state as the token loop, to 1e-6."""
    for tokens in (65, 129):
        inputs = random_kernel_inputs(rng, tokens, dim=64)
        _, chunk_state = run_kernel(naive.chunk_kda, inputs)
        _, loop_state = run_kernel(naive.fused_recurrent_kda, inputs)
        np.testing.assert_allclose(chunk_state, loop_state, atol=1e-6, rtol=1e-6)


def test_jit_compiles_once_per_shape(rng):
    """New sequence lengths with the same (T, N) reuse the compiled chunk kernel."""
    kernel = jax.jit(functools.partial(naive.chunk_kda, output_final_state=True))
    inputs = random_kernel_inputs(rng, 96)
    args = [jnp.asarray(inputs[name]) for name in ("q", "k", "v", "g", "beta")]
    for lengths in ([5, 17, 1, 73], [90, 2, 2, 2], [0, 0, 0, 96]):
        cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        jax.block_until_ready(kernel(*args, cu_seqlens=cu_seqlens))
    assert kernel._cache_size() == 1


def test_decode_writes_only_given_slots(rng):
    inputs = random_kernel_inputs(rng, 1, batch=3)
    buffer = rng.standard_normal((6, 2, 32, 32)).astype(np.float32)
    slots = np.array([4, 1, 2], np.int32)
    step = {name: x[:, 0] for name, x in inputs.items()}
    o, new_buffer = naive.decode_kda_slots(
        **step, state_buffer=buffer, slot_indices=slots, use_qk_l2norm_in_kernel=True
    )
    ref_o, ref_state = fla_reference(inputs, buffer[slots])
    np.testing.assert_allclose(np.asarray(o), ref_o[:, 0], **FP32)
    np.testing.assert_allclose(np.asarray(new_buffer)[slots], ref_state, **FP32)
    untouched = [0, 3, 5]
    np.testing.assert_array_equal(np.asarray(new_buffer)[untouched], buffer[untouched])


def test_decode_on_a_layered_pool(rng):
    """With layer_index the buffer is the whole pool; only that layer's given slots change."""
    inputs = random_kernel_inputs(rng, 1, batch=2)
    pool = rng.standard_normal((3, 5, 2, 32, 32)).astype(np.float32)
    slots = np.array([3, 1], np.int32)
    step = {name: x[:, 0] for name, x in inputs.items()}
    _, single_layer = naive.decode_kda_slots(**step, state_buffer=pool[2], slot_indices=slots)
    _, new_pool = naive.decode_kda_slots(**step, state_buffer=pool, slot_indices=slots, layer_index=2)
    np.testing.assert_array_equal(np.asarray(new_pool)[2], np.asarray(single_layer))
    np.testing.assert_array_equal(np.asarray(new_pool)[:2], pool[:2])
    with pytest.raises(ValueError, match="layer_index=3 is outside the pool's 3 layers"):
        naive.decode_kda_slots(**step, state_buffer=pool, slot_indices=slots, layer_index=3)
    with pytest.raises(ValueError, match=r"must be \[L, S, H, K, V\] \(layer_index given\)"):
        naive.decode_kda_slots(**step, state_buffer=pool[0], slot_indices=slots, layer_index=0)


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        ([0, 5, 3, 10], "non-decreasing"),
        ([0, 5, 9], "must end at the token count T=10"),
        ([1, 5, 10], "must start at 0"),
    ],
)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_bad_cu_seqlens_is_named(rng, kernel, cu_seqlens, message):
    inputs = random_kernel_inputs(rng, 10)
    with pytest.raises(ValueError, match=message):
        KERNELS[kernel](**inputs, cu_seqlens=np.asarray(cu_seqlens, np.int32))


def test_bad_shapes_are_named(rng):
    inputs = random_kernel_inputs(rng, 10, batch=2)
    with pytest.raises(ValueError, match=r"k.shape=\(2, 9, 2, 32\) must equal q.shape"):
        naive.chunk_kda(**{**inputs, "k": inputs["k"][:, :9]})
    with pytest.raises(ValueError, match="v must be"):
        naive.chunk_kda(**{**inputs, "v": np.zeros((2, 10, 3, 32), np.float32)})
    with pytest.raises(ValueError, match="packed into B=1"):
        naive.chunk_kda(**inputs, cu_seqlens=np.array([0, 10], np.int32))
    with pytest.raises(ValueError, match=r"initial_state.shape=\(1, 2, 32, 32\) must be \[N, H, K, V\]"):
        naive.fused_recurrent_kda(**inputs, initial_state=np.zeros((1, 2, 32, 32), np.float32))
    with pytest.raises(ValueError, match="slot index 9 is outside"):
        step = {name: x[:, 0] for name, x in inputs.items()}
        naive.decode_kda_slots(
            **step, state_buffer=np.zeros((4, 2, 32, 32), np.float32), slot_indices=np.array([0, 9])
        )
