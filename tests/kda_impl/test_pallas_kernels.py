"""The Pallas KDA kernels (interpret mode on CPU) against their references (the chunk form in float64,
the token recurrence), the plain-JAX kernels and fla-core's torch references, on seeded inputs
(`$KDA_TEST_SEED`). Their lowering and compile for TPU: test_tpu_compile.py.

Sizes stay small (H=2, D=128, the TPU-tile-friendly minimum of the last dim): compiling the interpreted
kernels dominates the run time, so the tests share a few shapes.
"""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.kernels import naive, pallas
from kda_impl.kernels.pallas import tuning
from tests.kda_impl.kernel_inputs import (
    fla_reference,
    random_kernel_inputs,
    reference_chunk_fp64,
    run_kernel,
    traces_over_batches,
    with_full_resets,
)

FP32 = {"atol": 1e-5, "rtol": 1e-5}
HEADS, DIM = 2, 128
PALLAS = {"chunk": pallas.chunk_kda, "recurrent": pallas.fused_recurrent_kda}
# The reference each kernel is held to: the chunk form in float64, the token recurrence.
REFERENCES = {
    "chunk": reference_chunk_fp64,
    "recurrent": functools.partial(run_kernel, naive.fused_recurrent_kda),
}
# One packed batch for most tests (one compilation per kernel): short sequences, one token, a whole chunk,
# partial last chunks, several chunks, and empty sequences first, in the middle and last.
LENGTHS = [0, 5, 17, 1, 64, 0, 65, 41, 200, 0]


def random_states(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.standard_normal((count, HEADS, DIM, DIM)).astype(np.float32)


def assert_all_equal(results: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Every (o, state) pair equals the first one to fp32 tolerance, and all are finite."""
    (_, (ref_o, ref_state)), *others = results.items()
    for name, (o, state) in others:
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(state)), name
        np.testing.assert_allclose(o, ref_o, **FP32, err_msg=f"{name}: o")
        np.testing.assert_allclose(state, ref_state, **FP32, err_msg=f"{name}: state")


def packed_inputs(rng: np.random.Generator, decay: str = "realistic") -> tuple[dict, np.ndarray, np.ndarray]:
    """(inputs [1, T, H, D], cu_seqlens, initial states [N, H, D, D]) of the packed batch `LENGTHS`."""
    cu_seqlens = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    inputs = random_kernel_inputs(rng, int(cu_seqlens[-1]), heads=HEADS, dim=DIM, decay=decay)
    return inputs, cu_seqlens, random_states(rng, len(LENGTHS))


def assert_matches_fla_per_sequence(inputs, cu_seqlens, h0, o, state) -> None:
    """Each sequence of the packed batch equals fla on that sequence alone; empty ones keep h0 exactly."""
    for i, (start, end) in enumerate(itertools.pairwise(cu_seqlens)):
        if start == end:
            np.testing.assert_array_equal(state[i], h0[i], err_msg=f"empty sequence {i}")
            continue
        alone = {name: x[:, start:end] for name, x in inputs.items()}
        ref_o, ref_state = fla_reference(alone, h0[i : i + 1])
        np.testing.assert_allclose(
            o[:, start:end], ref_o, **FP32, err_msg=f"o of sequence {i}, T={end - start}"
        )
        np.testing.assert_allclose(
            state[i], ref_state[0], **FP32, err_msg=f"state of sequence {i}, T={end - start}"
        )


@pytest.mark.torch
@pytest.mark.parametrize("decay", ["realistic", "strong", "mixed"])
@pytest.mark.parametrize("kernel", sorted(PALLAS))
def test_packed_batch_matches_its_reference_and_fla(rng, fla, kernel, decay):
    """Pallas == its reference == fla naive on every sequence of `LENGTHS`, with initial states.

    Lengths 1, 64, 65 and 200 cover one token, a whole chunk and partial last chunks; "strong" takes g
    down to -60 per token (the factorised form would overflow), "mixed" interleaves strong and near-zero
    decays (catches exponents formed as differences of prefix sums).
    """
    inputs, cu_seqlens, h0 = packed_inputs(rng, decay)
    o, state = run_kernel(PALLAS[kernel], inputs, initial_state=h0, cu_seqlens=cu_seqlens)
    assert_all_equal(
        {
            "reference": REFERENCES[kernel](inputs, initial_state=h0, cu_seqlens=cu_seqlens),
            "pallas": (o, state),
        }
    )
    assert_matches_fla_per_sequence(inputs, cu_seqlens, h0, o, state)


@pytest.mark.torch
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("kernel", sorted(PALLAS))
def test_equal_length_batch_matches_fla(rng, fla, kernel, with_state):
    """B requests of T tokens each (no cu_seqlens), T = 65: one chunk and one token."""
    inputs = random_kernel_inputs(rng, 65, heads=HEADS, dim=DIM, batch=2, decay="mixed")
    h0 = random_states(rng, 2) if with_state else None
    assert_all_equal(
        {
            "fla": fla_reference(inputs, h0),
            "pallas": run_kernel(PALLAS[kernel], inputs, initial_state=h0),
        }
    )


@pytest.mark.torch
@pytest.mark.parametrize("flat_dt_bias", [False, True], ids=["dt_bias[H,K]", "dt_bias[H*K]"])
def test_gate_in_kernel_equals_precomputed(rng, fla, flat_dt_bias):
    """`use_gate_in_kernel` == the kernels on fla's gate computed outside, padded chunk tails included
    (they must keep g = 0, or the final states would decay past the sequence end)."""
    import torch
    from fla.ops.kda.gate import naive_kda_gate

    inputs, cu_seqlens, h0 = packed_inputs(rng)
    raw = rng.normal(-3.0, 3.0, inputs["g"].shape).astype(np.float32)
    raw.flat[:: raw.size // 7] = 25.0  # a few past softplus' linear threshold of 20
    a_log = np.log(rng.uniform(1.0, 16.0, HEADS)).astype(np.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (HEADS, DIM)))
    dt_bias = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    g = naive_kda_gate(torch.from_numpy(raw), torch.from_numpy(a_log), torch.from_numpy(dt_bias.reshape(-1)))
    precomputed = {**inputs, "g": g.numpy()}
    packed = {"initial_state": h0, "cu_seqlens": cu_seqlens}
    assert_all_equal(
        {
            "naive, fla's gate": run_kernel(naive.chunk_kda, precomputed, **packed),
            "pallas, fla's gate": run_kernel(pallas.chunk_kda, precomputed, **packed),
            "pallas, gate in kernel": run_kernel(
                pallas.chunk_kda,
                {**inputs, "g": raw},
                **packed,
                use_gate_in_kernel=True,
                A_log=a_log,
                dt_bias=dt_bias.reshape(-1) if flat_dt_bias else dt_bias,
            ),
        }
    )


@pytest.mark.torch
@pytest.mark.parametrize("state_bytes_per_step", [tuning.DECODE_STATE_BYTES_PER_STEP, DIM * DIM * 4])
def test_decode_writes_only_given_slots(rng, fla, monkeypatch, state_bytes_per_step):
    """Decode updates exactly its requests' slots of one pool layer (all heads or one head per step)."""
    monkeypatch.setattr(tuning, "DECODE_STATE_BYTES_PER_STEP", state_bytes_per_step)
    inputs = random_kernel_inputs(rng, 1, heads=HEADS, dim=DIM, batch=3, decay="mixed")
    pool = random_states(rng, 3 * 6).reshape(3, 6, *random_states(rng, 1).shape[1:])  # [L, S, H, K, V]
    slots, layer = np.array([4, 1, 2], np.int32), 1
    step = {name: x[:, 0] for name, x in inputs.items()}
    kwargs = {"slot_indices": slots, "layer_index": layer, "use_qk_l2norm_in_kernel": True}
    o, new_pool = (
        np.asarray(x) for x in pallas.decode_kda_slots(**step, state_buffer=jnp.asarray(pool), **kwargs)
    )
    naive_o, naive_pool = (np.asarray(x) for x in naive.decode_kda_slots(**step, state_buffer=pool, **kwargs))
    ref_o, ref_state = fla_reference(inputs, pool[layer, slots])
    assert_all_equal({"fla": (ref_o[:, 0], ref_state), "pallas": (o, new_pool[layer, slots])})
    np.testing.assert_allclose(new_pool, naive_pool, **FP32)
    np.testing.assert_allclose(o, naive_o, **FP32)
    np.testing.assert_array_equal(new_pool[[0, 2]], pool[[0, 2]])  # other layers
    untouched = [0, 3, 5]
    np.testing.assert_array_equal(new_pool[layer, untouched], pool[layer, untouched])


def test_chunk_compiles_once_per_shape(rng):
    """New sequence lengths with the same (T, N) reuse the compiled kernel."""
    inputs = random_kernel_inputs(rng, 40, heads=HEADS, dim=DIM)
    batches = [[5, 17, 1, 17], [34, 2, 2, 2], [0, 0, 0, 40]]
    assert traces_over_batches(pallas.chunk_kda, inputs, batches) == [(5,)]


@pytest.mark.parametrize("kernel", sorted(PALLAS))
def test_full_reset_g_minus_inf_matches_the_token_recurrence(rng, kernel):
    """g = -inf (exp(g) = 0) on whole tokens at sequence and chunk edges and on random channels: the
    Pallas kernels give the plain-JAX token loop's finite result (unfloored, the chunk kernel's mask matmuls
    would give NaN)."""
    inputs, cu_seqlens, h0 = packed_inputs(rng)
    inputs = with_full_resets(inputs, rng, tokens=[5, 22, 23, 150, 151, 152, 214, 392])
    packed = {"initial_state": h0, "cu_seqlens": cu_seqlens}
    assert_all_equal(
        {
            "naive recurrent": run_kernel(naive.fused_recurrent_kda, inputs, **packed),
            f"pallas {kernel}": run_kernel(PALLAS[kernel], inputs, **packed),
        }
    )


def test_gate_in_kernel_softplus_matches_float64(rng):
    """The in-kernel gate's softplus to fp32 accuracy at z in {-16, -12, -8, 0, 19.9, 20.1, 30}.

    One token, beta = 0 and initial state 1: the final state is exp(g) with g = -exp(A_log) softplus(z),
    and A_log per head brings g near -1, where -log(state) recovers softplus(z) to ~1e-7 relative.
    """
    z = np.array([-16.0, -12.0, -8.0, 0.0, 19.9, 20.1, 30.0], np.float32)
    exact = np.where(z > 20, z, np.log1p(np.exp(z.astype(np.float64))))
    heads = z.size
    a_log = (-np.log(exact)).astype(np.float32)
    inputs = random_kernel_inputs(rng, 1, heads=heads, dim=DIM)
    inputs = {**inputs, "g": np.zeros_like(inputs["g"]), "beta": np.zeros_like(inputs["beta"])}
    _, state = run_kernel(
        pallas.chunk_kda,
        inputs,
        initial_state=np.ones((1, heads, DIM, DIM), np.float32),
        use_gate_in_kernel=True,
        A_log=a_log,
        dt_bias=np.repeat(z[:, None], DIM, axis=1),
    )
    recovered = -np.log(state[0, :, :, 0].astype(np.float64)) / np.exp(a_log.astype(np.float64))[:, None]
    np.testing.assert_allclose(recovered, np.broadcast_to(exact[:, None], recovered.shape), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kernel", sorted(PALLAS))
def test_integer_or_bool_inputs_are_refused(rng, kernel):
    inputs = random_kernel_inputs(rng, 8, heads=HEADS, dim=DIM)
    for name, dtype in (("q", "int32"), ("v", "int8"), ("beta", "bool")):
        with pytest.raises(ValueError, match=rf"^{name} must be a floating-point array, got dtype {dtype}$"):
            PALLAS[kernel](**{**inputs, name: inputs[name].astype(dtype)})


def test_gate_arguments_are_validated(rng):
    inputs = random_kernel_inputs(rng, 8, heads=HEADS, dim=DIM)
    with pytest.raises(ValueError, match="needs A_log"):
        pallas.chunk_kda(**inputs, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"A_log.shape=\(3,\) must be \[HV\]=\(2,\)"):
        pallas.chunk_kda(**inputs, use_gate_in_kernel=True, A_log=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"dt_bias.shape=\(2, 64\) must be \[HV, K\]"):
        pallas.chunk_kda(
            **inputs, use_gate_in_kernel=True, A_log=np.zeros(2, np.float32), dt_bias=np.zeros((2, 64))
        )
    with pytest.raises(ValueError, match="only used with use_gate_in_kernel=True"):
        pallas.chunk_kda(**inputs, A_log=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64 for KDA, got 40"):
        pallas.chunk_kda(**inputs, chunk_size=40)
