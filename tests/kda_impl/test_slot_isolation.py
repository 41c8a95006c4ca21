"""Two requests never touch each other's state, whatever slot indices arrive.

Host side, every entry that takes slots or lengths refuses out-of-range, reserved (dummy) and repeated
slots and non-integer values with a ValueError naming the slot and the pool size. Under `jit`, where no
value can be checked, indices injected straight into the metadata (bypassing those checks) behave
exactly as the dummy slot would: no real slot is read or written through them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.kernels import naive, pallas
from kda_impl.kernels.slots import DUMMY_SLOT, route_unsafe_slots_to_dummy
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.mem_cache.slot_allocator import SlotAllocator
from kda_impl.model_executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    make_dp_forward_batch,
    make_forward_batch,
)
from kda_spec.config import get_preset
from tests.kda_impl.conftest import NUM_SLOTS, LayerRunner, random_tokens

CONFIG = get_preset("mini")
POOL_SLOTS = 5
DECODE_KERNELS = {
    "naive": naive.decode_kda_slots,
    "pallas": functools.partial(pallas.decode_kda_slots, interpret=True),
}
OUT_OF_RANGE = r"out of range: real slots are 1\.\.5 of the 5-slot pool"


def pool_with_random_states(num_slots: int = POOL_SLOTS, dp: int = 1, seed: int = 0) -> RecurrentStatePool:
    """A pool (layer 0 only) of `dp` data ranks whose every row, dummies included, holds random states."""
    pool = RecurrentStatePool.create(CONFIG, num_slots, layer_ids=(0,))
    rng = np.random.default_rng(seed)
    rows = dp * (num_slots + 1)
    recurrent = rng.standard_normal((1, rows, *pool.recurrent_buffer.shape[2:])).astype(np.float32)
    conv = rng.standard_normal((1, rows, *pool.conv_buffer.shape[2:])).astype(np.float32)
    allocators = tuple(SlotAllocator(num_slots) for _ in range(dp))
    return RecurrentStatePool(jnp.asarray(recurrent), jnp.asarray(conv), (0,), allocators)


# --- host side: every entry refuses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "seq_lens", "slots", "extra", "message"),
    [
        (ForwardMode.EXTEND, [4], [99], {}, rf"slot 99 is {OUT_OF_RANGE}"),
        (ForwardMode.EXTEND, [4], [-1], {}, rf"slot -1 is {OUT_OF_RANGE}"),
        (
            ForwardMode.EXTEND,
            [4],
            [DUMMY_SLOT],
            {},
            rf"slot 0 is {OUT_OF_RANGE} \(slot 0 is the reserved dummy\)",
        ),
        (
            ForwardMode.EXTEND,
            [4, 2],
            [3, 3],
            {},
            r"slot 3 is given to two requests of one batch: .* 5-slot pool",
        ),
        (ForwardMode.DECODE, [1, 1, 1], [2, 1, 2], {}, r"slot 2 is given to two requests"),
        (ForwardMode.DECODE, [1], [0], {}, rf"slot 0 is {OUT_OF_RANGE}"),
        (ForwardMode.EXTEND, [4], [1.0], {}, r"recurrent_indices must be integers .*got 1\.0"),
        (
            ForwardMode.EXTEND,
            [4],
            np.array([1.0]),
            {},
            r"recurrent_indices must be integers, got dtype float64",
        ),
        (ForwardMode.EXTEND, [4], [True], {}, r"recurrent_indices must be integers .*got True"),
        (ForwardMode.EXTEND, [4.0], [1], {}, r"seq_lens must be integers .*got 4\.0"),
        (ForwardMode.EXTEND, [4.7], [1], {}, r"seq_lens must be integers .*got 4\.7"),
        (ForwardMode.DECODE, [True], [1], {}, r"seq_lens must be integers .*got True"),
        (ForwardMode.EXTEND, np.array([4.0]), [1], {}, r"seq_lens must be integers, got dtype float64"),
        (ForwardMode.EXTEND, [4], [1], {"prefix_lens": [2.5]}, r"prefix_lens must be integers .*got 2\.5"),
        (
            ForwardMode.EXTEND,
            [4],
            [1],
            {"num_slots": 5.0},
            r"num_slots must be a positive int \(the pool's num_slots\), got 5\.0",
        ),
    ],
)
def test_make_forward_batch_refuses(mode, seq_lens, slots, extra, message):
    kwargs = {"num_slots": POOL_SLOTS, **extra}
    with pytest.raises(ValueError, match=message):
        make_forward_batch(KDAAttnBackend(kernel="naive"), mode, seq_lens, slots, **kwargs)


def test_each_data_rank_has_its_own_dummy_and_slot_numbers():
    backend = KDAAttnBackend(kernel="naive")
    batch = make_dp_forward_batch(backend, ForwardMode.DECODE, [[1], [1]], [[1], [1]], num_slots=POOL_SLOTS)
    np.testing.assert_array_equal(
        np.asarray(batch.attn_backend.forward_metadata.recurrent_indices)[[0, 8]], [1, 1]
    )
    with pytest.raises(ValueError, match=rf"data rank 1: slot 0 is {OUT_OF_RANGE}"):
        make_dp_forward_batch(backend, ForwardMode.DECODE, [[1], [1]], [[1], [0]], num_slots=POOL_SLOTS)
    with pytest.raises(ValueError, match=r"data rank 0: slot 4 is given to two requests"):
        make_dp_forward_batch(backend, ForwardMode.DECODE, [[1, 1], [1]], [[4, 4], [2]], num_slots=POOL_SLOTS)


def test_metadata_builder_accepts_repeated_dummy_padding_and_refuses_the_rest():
    backend = KDAAttnBackend(kernel="naive")
    metadata = backend.get_forward_metadata(
        ForwardMode.DECODE, [1, 1, 1, 1], [3, 1, 0, 0], num_slots=POOL_SLOTS
    )
    np.testing.assert_array_equal(metadata.recurrent_indices, [3, 1, 0, 0])
    for slots, message in [
        ([3, 99, 0, 0], rf"slot 99 is {OUT_OF_RANGE}"),
        ([3, -1, 0, 0], rf"slot -1 is {OUT_OF_RANGE}"),
        ([3, 3, 0, 0], r"slot 3 is given to two requests"),
        (np.array([3.0, 1.0, 0.0, 0.0]), r"recurrent_indices must be integers, got dtype float64"),
    ]:
        with pytest.raises(ValueError, match=message):
            backend.get_forward_metadata(ForwardMode.DECODE, [1, 1, 1, 1], slots, num_slots=POOL_SLOTS)
    with pytest.raises(ValueError, match=r"seq_lens must be integers"):
        backend.get_forward_metadata(ForwardMode.EXTEND, [2.0, 1.0], [1, 2], num_slots=POOL_SLOTS)


def test_pool_host_methods_refuse():
    pool = RecurrentStatePool.create(CONFIG, POOL_SLOTS, layer_ids=(0,))
    pool.alloc(2)
    for bad_n in (2.0, True, 1.5):
        with pytest.raises(ValueError, match=r"alloc needs a whole number of slots"):
            pool.alloc(bad_n)
    with pytest.raises(ValueError, match=r"slots must be integers .*got 1\.0"):
        pool.free([1.0])
    with pytest.raises(ValueError, match=r"slots must be integers .*got True"):
        pool.free([True])
    with pytest.raises(ValueError, match=r"slot 2 is given to two requests .* 5-slot pool"):
        pool.get_recurrent_indices([2, 2])
    with pytest.raises(ValueError, match=r"req_pool_indices must be integers, got dtype float32"):
        pool.get_recurrent_indices(np.array([1.0], np.float32))
    for slots, message in [([0], rf"slot 0 is {OUT_OF_RANGE}"), ([9], rf"slot 9 is {OUT_OF_RANGE}")]:
        with pytest.raises(ValueError, match=message):
            pool.rows(slots)
    with pytest.raises(ValueError, match=r"slots must be integers"):
        pool.rows([1.0])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([99], r"row 99 is outside the pool's 12 rows"),
        ([-1], r"row -1 is outside the pool's 12 rows"),
        ([0], r"row 0 is data rank 0's dummy slot 0"),
        ([6], r"row 6 is data rank 1's dummy slot 0"),  # the second rank's dummy
        ([7, 7], r"row 7 is given to two requests of one batch"),
        (np.array([1.0]), r"slot_indices must be integers, got dtype float64"),
    ],
)
def test_pool_layer_access_refuses_bad_rows_outside_jit(rows, message):
    pool = pool_with_random_states(dp=2)  # rows: rank 0 → 0..5, rank 1 → 6..11
    states = pool.get_slot_states(0, jnp.asarray([1, 7]))
    with pytest.raises(ValueError, match=message):
        pool.get_slot_states(0, rows)
    n = len(rows)
    with pytest.raises(ValueError, match=message):
        pool.set_linear_recurrent_layer_cache(
            0, rows, jnp.zeros((n, *states[0].shape[1:])), jnp.zeros((n, *states[1].shape[1:]))
        )
    with pytest.raises(ValueError, match=message):
        pool.set_conv_states(0, rows, jnp.zeros((n, *states[1].shape[1:])))


def decode_step(batch: int, seed: int = 1) -> dict[str, np.ndarray]:
    """One decode token for `batch` requests at the Pallas-friendly size H=2, D=128."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((batch, 2, 128)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.0, 0.5, (batch, 2, 128)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (batch, 2)).astype(np.float32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def random_state_buffer(layers: int, rows: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((layers, rows, 2, 128, 128)).astype(np.float32)


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([1, 9], r"slot index 9 is outside the state buffer's 4 slots"),
        ([1, -1], r"slot index -1 is outside the state buffer's 4 slots"),
        ([2, 2], r"slot 2 is given to two requests of one batch: .* 3-slot pool"),
        (np.array([1.0, 2.0]), r"slot_indices must be integers, got dtype float64"),
        (np.array([True, False]), r"slot_indices must be integers, got dtype bool"),
    ],
)
def test_decode_kernel_eager_entry_refuses(kernel, slots, message):
    buffer = random_state_buffer(1, 4)[0]
    with pytest.raises(ValueError, match=message):
        DECODE_KERNELS[kernel](**decode_step(2), state_buffer=buffer, slot_indices=slots)


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
def test_decode_kernel_refuses_float_indices_under_jit(kernel):
    step = jax.jit(
        lambda idx: DECODE_KERNELS[kernel](
            **decode_step(2), state_buffer=random_state_buffer(1, 4)[0], slot_indices=idx
        )
    )
    with pytest.raises(ValueError, match=r"slot_indices must be integers, got dtype float32"):
        step(jnp.asarray([1.0, 2.0], jnp.float32))


# --- inside jit: unsafe indices act as the dummy slot ----------------------------------------------------


def test_routing_sends_out_of_range_and_repeated_rows_to_the_dummy():
    routed = jax.jit(route_unsafe_slots_to_dummy, static_argnums=1)(
        jnp.asarray([99, -1, 3, 3, 0, 0, 2, 5]), 5
    )
    np.testing.assert_array_equal(routed, [0, 0, 0, 0, 0, 0, 2, 0])
    # Rows that are multiples of `block` are every data rank's dummies: padding rows may share them.
    routed = route_unsafe_slots_to_dummy(jnp.asarray([3, 3, 4, 4, 5, 6]), 6, block=3)
    np.testing.assert_array_equal(routed, [3, 3, 0, 0, 5, 0])


def assert_unsafe_rows_act_as_the_dummy(run, injected: Sequence[int], start: Sequence[np.ndarray]) -> None:
    """`run(indices)` → `(outputs, buffers)` from the same starting `buffers`: the run with `injected`
    indices (valid ones kept, the rest out of range or repeated) equals the run with the dummy in their
    place, bit for bit (the dummy rows aside); every real row but the valid ones is unchanged."""
    valid = [slot for slot in injected if slot > 0 and injected.count(slot) == 1 and slot < start[0].shape[1]]
    as_dummy = [slot if slot in valid else DUMMY_SLOT for slot in injected]
    outs, buffers = run(injected)
    dummy_outs, dummy_buffers = run(as_dummy)
    np.testing.assert_array_equal(outs, dummy_outs)  # nothing real was read for the unsafe rows
    real_rows = list(range(1, start[0].shape[1]))
    untouched = [row for row in real_rows if row not in valid]
    for buffer, dummy_buffer, before in zip(buffers, dummy_buffers, start):
        np.testing.assert_array_equal(buffer[:, real_rows], dummy_buffer[:, real_rows])
        np.testing.assert_array_equal(buffer[:, untouched], before[:, untouched])  # nothing real written
        assert not np.array_equal(buffer[:, valid], before[:, valid])  # the valid request was served


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
def test_decode_kernel_under_jit_never_aliases_a_real_slot(kernel):
    start = random_state_buffer(2, 6)  # [L=2, S=6]: slot 0 the dummy, 1..5 real
    injected = [2, 99, -1, 6, 4, 4]
    step = jax.jit(functools.partial(DECODE_KERNELS[kernel], layer_index=1, **decode_step(len(injected))))

    def run(indices: Sequence[int]) -> tuple[np.ndarray, tuple[np.ndarray]]:
        o, buffer = step(state_buffer=jnp.asarray(start), slot_indices=jnp.asarray(indices, jnp.int32))
        return np.asarray(o), (np.asarray(buffer)[1:],)

    assert_unsafe_rows_act_as_the_dummy(run, injected, (start[1:],))
    _, buffer = step(state_buffer=jnp.asarray(start), slot_indices=jnp.asarray(injected, jnp.int32))
    np.testing.assert_array_equal(np.asarray(buffer)[0], start[0])  # the other layer


def test_pool_layer_access_under_jit_never_aliases_a_real_slot():
    pool = pool_with_random_states()
    start = (np.asarray(pool.recurrent_buffer), np.asarray(pool.conv_buffer))
    injected = [3, 99, -1, 6, 2, 2]

    @jax.jit
    def read_and_write(pool: RecurrentStatePool, indices: jax.Array) -> tuple[jax.Array, RecurrentStatePool]:
        recurrent, conv = pool.get_slot_states(0, indices)
        pool = pool.set_linear_recurrent_layer_cache(0, indices, recurrent + 1, conv + 1)
        return jnp.sum(recurrent, axis=(1, 2, 3)) + jnp.sum(conv, axis=(1, 2, 3)), pool

    def run(indices: Sequence[int]) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        fresh = pool.replace(recurrent_buffer=jnp.asarray(start[0]), conv_buffer=jnp.asarray(start[1]))
        read, new = read_and_write(fresh, jnp.asarray(indices, jnp.int32))
        return np.asarray(read), (np.asarray(new.recurrent_buffer), np.asarray(new.conv_buffer))

    assert_unsafe_rows_act_as_the_dummy(run, injected, start)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_serving_step_under_jit_never_aliases_a_real_slot(mode, runner_for):
    """The whole layer (jit_forward, pool donated) with unsafe indices injected into a built batch:
    slot 5 valid, then past the pool, negative, one past the last row, and slot 3 given twice."""
    injected = [5, 99, -1, NUM_SLOTS + 1, 3, 3]
    runner: LayerRunner = runner_for("mini")
    rng = np.random.default_rng(3)
    lens = [7, 3, 12, 1, 5, 9] if mode == ForwardMode.EXTEND else [1] * len(injected)
    xs = [random_tokens(rng, runner.config, n) for n in lens]
    batch = runner.batch(mode, lens, runner.alloc(len(lens)))
    saved = (
        np.asarray(runner.pool.recurrent_buffer),
        np.asarray(runner.pool.conv_buffer.astype(jnp.float32)),
    )
    start = tuple(rng.standard_normal(buffer.shape).astype(np.float32) for buffer in saved)

    def run(indices: Sequence[int]) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        runner.pool = runner.pool.replace(
            recurrent_buffer=jnp.asarray(start[0]), conv_buffer=jnp.asarray(start[1], runner.dtype)
        )
        padded = np.full(batch.batch_size, DUMMY_SLOT, np.int32)
        padded[: len(indices)] = indices
        out = np.concatenate(runner.run(inject(batch, padded), xs).outs)
        return out, (np.asarray(runner.pool.recurrent_buffer), np.asarray(runner.pool.conv_buffer))

    try:
        assert_unsafe_rows_act_as_the_dummy(run, injected, start)
    finally:
        runner.pool = runner.pool.replace(
            recurrent_buffer=jnp.asarray(saved[0]), conv_buffer=jnp.asarray(saved[1], runner.dtype)
        )


def inject(batch: ForwardBatch, recurrent_indices: np.ndarray) -> ForwardBatch:
    """`batch` with its metadata's slot indices replaced, as no host-side entry would allow."""
    metadata = batch.attn_backend.forward_metadata
    injected = type(metadata)(cu_q_lens=metadata.cu_q_lens, recurrent_indices=jnp.asarray(recurrent_indices))
    return batch.replace(attn_backend=batch.attn_backend.with_forward_metadata(injected))
