"""The plain-JAX kernels against fla-core's torch references, the token recurrence and the chunk form's
reference (`reference_chunk_kda` in float64), on seeded inputs (`$KDA_TEST_SEED`, see
kernel_inputs.seeded_rng)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.kernels import naive
from kda_impl.kernels.common import softplus
from kda_spec.truth import packed_delta_rule
from tests.kda_impl.kernel_inputs import (
    DEFAULT_SEED,
    SEED_ENV,
    fla_reference,
    l2normalise,
    random_kernel_inputs,
    reference_chunk_fp64,
    run_kernel,
    seed_from_env,
    seeded_rng,
    traces_over_batches,
    with_full_resets,
)

FP32 = {"atol": 1e-5, "rtol": 1e-5}


# The plain-JAX kernels, and the chunk form's reference in float32 (held to fla and to the same argument
# checks as the kernels).
KERNELS = {
    "chunk": naive.chunk_kda,
    "recurrent": naive.fused_recurrent_kda,
    "reference_chunk": naive.reference_chunk_kda,
}


@pytest.mark.torch
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_matches_fla_naive(rng, fla, kernel, tokens, with_state):
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
    """g down to -60 per token: the factorised form would overflow; results stay finite and exact, against
    the chunk form in float64."""
    inputs = random_kernel_inputs(rng, tokens, decay=decay)
    h0 = rng.standard_normal((1, 2, 32, 32)).astype(np.float32)
    o, state = run_kernel(naive.chunk_kda, inputs, initial_state=h0)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state))
    ref_o, ref_state = reference_chunk_fp64(inputs, h0)
    np.testing.assert_allclose(o, ref_o, **FP32)
    np.testing.assert_allclose(state, ref_state, **FP32)


def test_head_dim_128_long_sequence(rng):
    """The real head size over a long sequence: chunk == the chunk form in float64, state included."""
    inputs = random_kernel_inputs(rng, 1000, heads=2, dim=128)
    o, state = run_kernel(naive.chunk_kda, inputs)
    ref_o, ref_state = reference_chunk_fp64(inputs)
    np.testing.assert_allclose(o, ref_o, **FP32)
    np.testing.assert_allclose(state, ref_state, **FP32)


@pytest.mark.torch
@pytest.mark.parametrize("lengths", [[5, 17, 1, 41], [64, 1, 65], [3, 0, 70, 0]])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_packed_batch_matches_each_sequence_alone(rng, fla, kernel, lengths):
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


@pytest.mark.parametrize("decay", ["realistic", "strong", "mixed"])
def test_chunk_matches_the_chunk_form(rng, decay):
    """The optimised chunk kernel == its readable reference, `reference_chunk_kda` in float64, on a packed
    batch with initial states: partial chunks, a whole chunk, an empty sequence, several chunks."""
    lengths = [3, 0, 64, 65, 130]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = random_kernel_inputs(rng, int(cu_seqlens[-1]), decay=decay)
    h0 = rng.standard_normal((len(lengths), 2, 32, 32)).astype(np.float32)
    packed = {"initial_state": h0, "cu_seqlens": cu_seqlens}
    o, state = run_kernel(naive.chunk_kda, inputs, **packed)
    ref_o, ref_state = reference_chunk_fp64(inputs, **packed)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state))
    np.testing.assert_allclose(o, ref_o, **FP32)
    np.testing.assert_allclose(state, ref_state, **FP32)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("decay", ["realistic", "strong", "mixed"])
def test_naive_chunk_matches_the_float64_recurrence(rng, decay, chunk_size):
    """`reference_chunk_kda` in float64 == the token recurrence in float64 (`kda_spec.truth`) to float64
    rounding, g down to -60 per token included: empty, one-token, partial and whole-chunk sequences."""
    lengths = [0, 1, 15, 16, 63, 64, 65, 130]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = random_kernel_inputs(rng, int(cu_seqlens[-1]), decay=decay)
    h0 = rng.standard_normal((len(lengths), 2, 32, 32))
    o, state = reference_chunk_fp64(inputs, h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    wide = {name: x[0].astype(np.float64) for name, x in inputs.items()}
    q, k = l2normalise(wide["q"]), l2normalise(wide["k"])
    ref_o, ref_state = packed_delta_rule(q, k, wide["v"], wide["g"], wide["beta"], cu_seqlens, h0)
    assert o.dtype == state.dtype == np.float64
    np.testing.assert_allclose(o[0], ref_o, atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(state, ref_state, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
def test_naive_chunk_matches_the_token_recurrence(rng, with_state):
    """In float32, with the kernels' arguments: B = 2 rows of T = 70 tokens (no cu_seqlens, a partial last
    chunk), a given scale, with and without initial states: `reference_chunk_kda` == `fused_recurrent_kda`."""
    inputs = random_kernel_inputs(rng, 70, batch=2)
    h0 = rng.standard_normal((2, 2, 32, 32)).astype(np.float32) if with_state else None
    o, state = run_kernel(naive.reference_chunk_kda, inputs, initial_state=h0, scale=0.3)
    ref_o, ref_state = run_kernel(naive.fused_recurrent_kda, inputs, initial_state=h0, scale=0.3)
    assert o.dtype == state.dtype == np.float32
    np.testing.assert_allclose(o, ref_o, **FP32)
    np.testing.assert_allclose(state, ref_state, **FP32)
    o, no_state = naive.reference_chunk_kda(**inputs)
    assert no_state is None and o.shape == inputs["v"].shape


def test_full_reset_g_minus_inf_matches_the_token_recurrence(rng):
    """g = -inf (exp(g) = 0: the state forgets that channel) gives the token loop's finite result, with
    whole tokens reset at sequence and chunk starts and ends and random single channels."""
    lengths = [70, 1, 64, 30]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = random_kernel_inputs(rng, int(cu_seqlens[-1]))
    inputs = with_full_resets(inputs, rng, tokens=[0, 5, 63, 64, 69, 70, 71, 134, 164])
    h0 = rng.standard_normal((len(lengths), 2, 32, 32)).astype(np.float32)
    packed = {"initial_state": h0, "cu_seqlens": cu_seqlens}
    loop_o, loop_state = run_kernel(naive.fused_recurrent_kda, inputs, **packed)
    o, state = run_kernel(naive.chunk_kda, inputs, **packed)
    assert np.all(np.isfinite(loop_o)) and np.all(np.isfinite(loop_state))
    np.testing.assert_allclose(o, loop_o, **FP32)
    np.testing.assert_allclose(state, loop_state, **FP32)


def test_jit_compiles_once_per_shape(rng):
    """New sequence lengths with the same (T, N) reuse the compiled chunk kernel."""
    batches = [[5, 17, 1, 73], [90, 2, 2, 2], [0, 0, 0, 96]]
    assert traces_over_batches(naive.chunk_kda, random_kernel_inputs(rng, 96), batches) == [(5,)]


@pytest.mark.torch
def test_decode_writes_only_given_slots(rng, fla):
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
    with pytest.raises(ValueError, match=r"v has HV=3 heads, which must be a multiple of q's H=2"):
        naive.chunk_kda(**{**inputs, "v": np.zeros((2, 10, 3, 32), np.float32)})
    with pytest.raises(ValueError, match="packed into B=1"):
        naive.chunk_kda(**inputs, cu_seqlens=np.array([0, 10], np.int32))
    with pytest.raises(ValueError, match=r"initial_state.shape=\(1, 2, 32, 32\) must be \[N, HV, K, V\]"):
        naive.fused_recurrent_kda(**inputs, initial_state=np.zeros((1, 2, 32, 32), np.float32))
    with pytest.raises(ValueError, match="slot index 9 is outside"):
        step = {name: x[:, 0] for name, x in inputs.items()}
        naive.decode_kda_slots(
            **step, state_buffer=np.zeros((4, 2, 32, 32), np.float32), slot_indices=np.array([0, 9])
        )


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_integer_or_bool_inputs_are_refused(rng, kernel, name):
    """An integer or bool input would come back truncated (o takes q's dtype): refused, named."""
    inputs = random_kernel_inputs(rng, 10)
    for dtype in ("int32", "bool"):
        with pytest.raises(ValueError, match=rf"^{name} must be a floating-point array, got dtype {dtype}$"):
            KERNELS[kernel](**{**inputs, name: inputs[name].astype(dtype)})


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_decode_refuses_integer_or_bool_inputs(rng, name):
    """The decode entry too: an integer token would be truncated into the pool's state."""
    step = {key: x[:, 0] for key, x in random_kernel_inputs(rng, 1, batch=2).items()}
    buffer = np.zeros((3, 2, 32, 32), np.float32)
    for dtype in ("int32", "bool"):
        with pytest.raises(ValueError, match=rf"^{name} must be a floating-point array, got dtype {dtype}$"):
            naive.decode_kda_slots(
                **{**step, name: step[name].astype(dtype)}, state_buffer=buffer, slot_indices=np.array([1, 2])
            )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_softplus_matches_float64(jit):
    """torch's softplus to fp32 accuracy: `log(1 + exp(z))` is 0.9 % off at z = -12, 6 % at -16, 0 below."""
    z = np.array([-30.0, -16.0, -12.0, -8.0, 0.0, 19.9, 20.1, 30.0], np.float32)
    exact = np.where(z > 20, z, np.log1p(np.exp(z.astype(np.float64))))
    fn = jax.jit(softplus) if jit else softplus
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(z)), np.float64), exact, rtol=1e-6, atol=0)


def test_seed_comes_from_the_environment(monkeypatch, request):
    """`$KDA_TEST_SEED` fixes every seeded test's inputs (default `DEFAULT_SEED`), so a failure replays."""
    monkeypatch.setenv(SEED_ENV, "7")
    first, again = (seeded_rng(request).standard_normal(4) for _ in range(2))
    monkeypatch.setenv(SEED_ENV, "8")
    other = seeded_rng(request).standard_normal(4)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert (SEED_ENV, 7) in request.node.user_properties
    monkeypatch.delenv(SEED_ENV)
    assert seed_from_env() == DEFAULT_SEED
    monkeypatch.setenv(SEED_ENV, "x1")
    with pytest.raises(ValueError, match=r"\$KDA_TEST_SEED='x1' must be a non-negative integer"):
        seed_from_env()
