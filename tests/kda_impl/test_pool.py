"""RecurrentStatePool: slot bookkeeping, zero-on-alloc, per-layer access, pytree behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.mem_cache.recurrent_state_pool import DUMMY_SLOT, PoolExhaustedError, RecurrentStatePool
from kda_spec.config import get_preset

CONFIG = get_preset("mini").replace(kda_layers=(1, 2, 4), num_hidden_layers=4)


def make_pool(num_slots: int = 4, dtype=jnp.float32) -> RecurrentStatePool:
    return RecurrentStatePool.create(CONFIG, num_slots, dtype)


def fill(pool: RecurrentStatePool, layer_id: int, slots: list[int], value: float) -> RecurrentStatePool:
    """Write `value` into every element of `slots` of one layer."""
    recurrent, conv = pool.get_linear_recurrent_layer_cache(layer_id)
    new_recurrent = jnp.full((len(slots), *recurrent.shape[1:]), value, recurrent.dtype)
    new_conv = jnp.full((len(slots), *conv.shape[1:]), value, conv.dtype)
    return pool.set_linear_recurrent_layer_cache(
        layer_id, jnp.asarray(slots, jnp.int32), new_recurrent, new_conv
    )


def test_create_shapes_and_layers():
    pool = make_pool(num_slots=4, dtype=jnp.bfloat16)
    assert pool.layer_ids == (0, 1, 3)  # 1-based kda_layers (1, 2, 4)
    assert pool.recurrent_buffer.shape == (3, 5, 2, 64, 64)
    assert pool.recurrent_buffer.dtype == jnp.float32
    assert pool.conv_buffer.shape == (3, 5, 3, 3, 128)  # [L, slots+1, W-1, q|k|v, P]
    assert pool.conv_buffer.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"layer 2 has no state in this pool; it holds layers \(0, 1, 3\)"):
        pool.get_linear_recurrent_layer_cache(2)


def test_alloc_hands_out_real_slots_lowest_first_and_never_the_dummy():
    pool = make_pool(num_slots=4)
    assert pool.alloc(3).tolist() == [1, 2, 3]
    pool.free([2])
    assert pool.alloc(2).tolist() == [2, 4]
    assert DUMMY_SLOT == 0


def test_exhaustion_names_request_and_capacity():
    pool = make_pool(num_slots=2)
    pool.alloc(1)
    with pytest.raises(PoolExhaustedError, match=r"2 slot\(s\) requested, 1 free of 2"):
        pool.alloc(2)


@pytest.mark.parametrize(
    ("to_free", "message"),
    [
        ([0], r"slot 0 is out of range: real slots are 1\.\.4"),
        ([5], r"slot 5 is out of range: real slots are 1\.\.4"),
        ([3], r"slot\(s\) \[3\] are not allocated \(double free\?\)"),
        ([1, 1], r"slot list \[1, 1\] frees slot 1 twice"),
    ],
)
def test_free_rejects_bad_slots(to_free, message):
    pool = make_pool(num_slots=4)
    pool.alloc(2)
    with pytest.raises(ValueError, match=message):
        pool.free(to_free)


def test_double_free():
    pool = make_pool()
    slots = pool.alloc(1)
    pool.free(slots)
    with pytest.raises(ValueError, match=r"slot\(s\) \[1\] are not allocated"):
        pool.free(slots)


def test_get_recurrent_indices_validates_slots():
    pool = make_pool(num_slots=4)
    slots = pool.alloc(2)
    indices = pool.get_recurrent_indices(slots)
    assert indices.dtype == np.int32 and indices.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"slot 7 is out of range: real slots are 1\.\.4"):
        pool.get_recurrent_indices([1, 7])
    with pytest.raises(ValueError, match=r"slot 0 is out of range"):
        pool.get_recurrent_indices([0])
    with pytest.raises(ValueError, match=r"slot 3 is not allocated"):
        pool.get_recurrent_indices([3])


def test_alloc_zeroes_the_slots_in_every_layer():
    pool = make_pool(num_slots=3)
    slots = pool.alloc(3).tolist()
    for layer_id in pool.layer_ids:
        pool = fill(pool, layer_id, slots, 7.0)
    pool.free([2, 3])
    assert pool.alloc(2).tolist() == [2, 3]
    recurrent, conv = np.asarray(pool.recurrent_buffer), np.asarray(pool.conv_buffer)
    assert np.all(recurrent[:, 2:] == 0) and np.all(conv[:, 2:] == 0)
    assert np.all(recurrent[:, 1] == 7) and np.all(conv[:, 1] == 7)  # slot 1 was not reallocated


def test_set_layer_cache_touches_only_those_slots_of_that_layer():
    pool = make_pool(num_slots=4)
    pool = fill(pool, 1, [2, 4], 3.0)
    recurrent = np.array(pool.recurrent_buffer)
    assert np.all(recurrent[1, [2, 4]] == 3)
    recurrent[1, [2, 4]] = 0
    assert not np.any(recurrent)


def test_set_layer_cache_checks_state_shapes():
    pool = make_pool()
    slots = jnp.asarray([1, 2], jnp.int32)
    good_conv = jnp.zeros((2, 3, 3, 128))
    with pytest.raises(
        ValueError, match=r"new_recurrent must be \[N=2, H, D, D\]=\(2, 2, 64, 64\), got \(2, 3, 64, 64\)"
    ):
        pool.set_linear_recurrent_layer_cache(0, slots, jnp.zeros((2, 3, 64, 64)), good_conv)
    with pytest.raises(
        ValueError, match=r"new_conv must be \[N=2, W-1, 3, P\]=\(2, 3, 3, 128\), got \(2, 3, 384\)"
    ):
        pool.set_linear_recurrent_layer_cache(0, slots, jnp.zeros((2, 2, 64, 64)), jnp.zeros((2, 3, 384)))


def test_pytree_carries_the_buffers_and_the_allocators_come_back_after_jit():
    pool = make_pool(num_slots=4)
    slots = pool.alloc(2)
    leaves = jax.tree_util.tree_leaves(pool)
    assert len(leaves) == 2  # the two buffers; bookkeeping is host-side

    @jax.jit
    def write(pool: RecurrentStatePool) -> RecurrentStatePool:
        return fill(pool, 3, [1, 2], 1.0)

    out = write(pool)
    assert out.allocators is None
    with pytest.raises(ValueError, match=r"came out of a jax transformation, .*with_allocators_of\("):
        out.alloc(1)
    new_pool = out.with_allocators_of(pool)
    assert new_pool.allocators is pool.allocators
    assert new_pool.alloc(1).tolist() == [3]  # the copy shares the free list
    assert np.all(np.asarray(new_pool.get_linear_recurrent_layer_cache(3)[0])[slots] == 1)


def test_pools_of_one_shape_share_a_compilation():
    """Two pools (two allocators) of one shape are one jit cache entry: a new pool per request batch or
    per serving session compiles nothing new."""
    traces = []

    @jax.jit
    def write(pool: RecurrentStatePool) -> RecurrentStatePool:
        traces.append(1)
        return fill(pool, 3, [1], 1.0)

    for _ in range(2):
        pool = make_pool(num_slots=4)
        pool.alloc(1)
        write(pool)
    assert len(traces) == 1


def test_with_allocators_of_refuses_another_shape():
    small, large = make_pool(num_slots=2), make_pool(num_slots=4)
    with pytest.raises(ValueError, match=r"cannot give its allocators"):
        large.with_allocators_of(small)


def test_create_needs_kda_layers():
    with pytest.raises(ValueError, match=r"names no KDA layers .* pass layer_ids"):
        RecurrentStatePool.create(CONFIG.replace(kda_layers=()), 2)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        RecurrentStatePool.create(CONFIG, 0)


# --- the whole-slot verbs: copy_slots, load_slot, accept_drafts ---------------------------------------


def _slot_states(pool: RecurrentStatePool, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(recurrent [L, H, D, D], conv [L, W-1, 3, P]) of `slot` in every layer."""
    return np.asarray(pool.recurrent_buffer[:, slot]), np.asarray(pool.conv_buffer[:, slot])


def test_copy_slots_copies_every_layer_and_nothing_else():
    pool = make_pool()
    pool.alloc(3)
    for layer, value in ((0, 1.0), (1, 2.0), (3, 3.0)):
        pool = fill(pool, layer, [1], value)
    pool = fill(pool, 1, [3], 7.0)
    before = _slot_states(pool, 3)
    copied = pool.copy_slots([1], [2])
    for got, want in zip(_slot_states(copied, 2), _slot_states(copied, 1)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(_slot_states(copied, 3), before):
        np.testing.assert_array_equal(got, want)
    assert np.asarray(copied.recurrent_buffer[:, 1, 0, 0, 0]).tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([1], [4], r"slot 4 is not allocated"),
        ([1], [1], r"none of them both: got \[1\] -> \[1\]"),
        ([1, 2], [3], r"as many sources as destinations"),
        ([1], [0], r"slot 0 is out of range: real slots are 1..4 of the 4-slot pool"),
    ],
)
def test_copy_slots_refuses_bad_slots(src, dst, message):
    pool = make_pool()
    pool.alloc(3)
    with pytest.raises(ValueError, match=message):
        pool.copy_slots(src, dst)


def test_load_slot_writes_one_slot_of_every_layer():
    pool = make_pool()
    pool.alloc(2)
    recurrent = np.full((3, *pool.recurrent_buffer.shape[2:]), 1e30, np.float32)
    conv = np.full((3, *pool.conv_buffer.shape[2:]), np.nan, np.float32)
    loaded = pool.load_slot(2, recurrent, conv)
    got_recurrent, got_conv = _slot_states(loaded, 2)
    np.testing.assert_array_equal(got_recurrent, recurrent)
    assert np.isnan(got_conv).all()
    assert not np.any(_slot_states(loaded, 1)[0])
    with pytest.raises(ValueError, match=r"load_slot: conv must be \(3, 3, 3, 128\)"):
        loaded.load_slot(1, recurrent, conv[:, :2])
    with pytest.raises(ValueError, match=r"slot 3 is not allocated"):
        loaded.load_slot(3, recurrent, conv)


def test_accept_drafts_keeps_the_state_after_the_accepted_ones():
    pool = make_pool()
    pool.alloc(3)
    with pytest.raises(ValueError, match=r"no draft buffers: with_draft_tokens\(k\)"):
        pool.accept_drafts([1], [0])
    pool = fill(pool.with_draft_tokens(3), 0, [1, 2, 3], -1.0)
    assert pool.draft_tokens == 3 and pool.draft_recurrent_buffer.shape == (3, 5, 3, 2, 64, 64)
    steps = jnp.arange(1.0, 4.0)  # draft state j holds j + 1
    draft_recurrent = jnp.broadcast_to(
        steps[None, None, :, None, None, None], pool.draft_recurrent_buffer.shape
    )
    draft_conv = jnp.broadcast_to(steps[None, None, :, None, None, None], pool.draft_conv_buffer.shape)
    pool = pool.replace(draft_recurrent_buffer=draft_recurrent, draft_conv_buffer=draft_conv)
    accepted = pool.accept_drafts([1, 2, 3], [0, 1, 3])
    assert [float(accepted.recurrent_buffer[0, s, 0, 0, 0]) for s in (1, 2, 3)] == [-1.0, 1.0, 3.0]
    assert [float(accepted.conv_buffer[0, s, 0, 0, 0]) for s in (1, 2, 3)] == [-1.0, 1.0, 3.0]
    with pytest.raises(ValueError, match=r"accepted \[4\] must give each of the slots \[1\] a count in 0..3"):
        accepted.accept_drafts([1], [4])


def test_the_draft_buffers_travel_through_jit():
    pool = make_pool().with_draft_tokens(2)
    leaves = jax.tree.leaves(pool)
    assert len(leaves) == 4
    twice = jax.jit(lambda p: p.replace(draft_recurrent_buffer=p.draft_recurrent_buffer + 2))(pool)
    assert twice.draft_tokens == 2 and float(twice.draft_recurrent_buffer[0, 0, 0, 0, 0, 0]) == 2.0
    assert type(twice.partition_specs()) is RecurrentStatePool
