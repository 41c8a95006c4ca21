"""Clear errors on bad inputs: offsets, shapes, head counts, slots, batches, layer indices."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conformance.adapters.kda_impl_adapter import KDACarry, KDAImplAdapter
from kda_impl.layers.radix_linear_attention import RadixLinearAttention
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode, make_forward_batch, seq_lens_from_cu_seqlens
from kda_impl.models.kimi_linear import KimiDeltaAttention
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights
from tests.kda_impl.conftest import CONFIGS, NUM_SLOTS, TOKEN_BUCKET, random_states

MINI = CONFIGS["mini"]


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        ([0, 5, 3, 8], r"non-decreasing: cu_seqlens\[1\]=5 > cu_seqlens\[2\]=3"),
        ([1, 8], r"must start at 0, got cu_seqlens\[0\]=1"),
        ([0, 5, 7], r"must end at the token count T=8, got cu_seqlens\[-1\]=7"),
        ([0, 5, 9], r"must end at the token count T=8, got cu_seqlens\[-1\]=9"),
        ([8], r"integer offsets \[N\+1\] with N >= 1"),
        ([[0, 8]], r"integer offsets \[N\+1\] with N >= 1"),
        ([0.0, 8.0], r"integer offsets \[N\+1\] with N >= 1"),
    ],
)
def test_bad_cu_seqlens(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        seq_lens_from_cu_seqlens(np.asarray(cu_seqlens), num_tokens=8)


@pytest.fixture(scope="module")
def adapter() -> KDAImplAdapter:
    return KDAImplAdapter(MINI, synthetic_weights(MINI, seed=0), "fp32")


def test_adapter_checks_offsets_states_and_carries(adapter):
    x = np.zeros((8, MINI.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"non-decreasing"):
        adapter.layer_extend(x, np.asarray([0, 5, 3, 8], np.int32))
    states = random_states(np.random.default_rng(0), MINI, 3)
    with pytest.raises(
        ValueError, match=r"initial_state must be \[N, H, D, D\]=\(2, 2, 64, 64\) for the 2 sequences"
    ):
        adapter.layer_extend(x, np.asarray([0, 5, 8], np.int32), initial_state=states)
    carry = KDACarry(jnp.asarray(states), jnp.zeros((3, MINI.conv_size - 1, 3, MINI.proj_dim)))
    with pytest.raises(ValueError, match=r"the carry holds 3 sequences, the call has 2"):
        adapter.layer_decode(x[:2], carry)
    with pytest.raises(ValueError, match=r"must end at the token count T=8"):
        adapter.chunk_kernel(
            *(np.zeros((8, 2, 64), np.float32),) * 4, np.zeros((8, 2), np.float32), [0, 7], None
        )
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp32'\], got 'fp16'"):
        KDAImplAdapter(MINI, synthetic_weights(MINI, seed=0), "fp16")


def test_hidden_states_of_the_wrong_width(runner_for):
    runner = runner_for("mini")
    batch = runner.batch(ForwardMode.EXTEND, [4], runner.alloc(1))
    with pytest.raises(ValueError, match=r"hidden_states must be \[T, hidden=128\], got \(256, 96\)"):
        runner.forward(jnp.zeros((TOKEN_BUCKET, 96)), batch, runner.pool)


def test_hidden_states_not_padded_to_the_batch(runner_for):
    runner = runner_for("mini")
    batch = runner.batch(ForwardMode.EXTEND, [4], runner.alloc(1))
    with pytest.raises(ValueError, match=r"hidden_states has 4 tokens but the batch is padded to 256"):
        runner.forward(jnp.zeros((4, MINI.hidden_size)), batch, runner.pool)


def test_pool_built_for_another_head_shape(runner_for):
    runner = runner_for("mini")
    batch = runner.batch(ForwardMode.EXTEND, [4], runner.alloc(1))
    other = RecurrentStatePool.create(CONFIGS["d128"], NUM_SLOTS, layer_ids=(0,))
    with pytest.raises(
        ValueError, match=r"pool holds states \[H, D, D\]=\(3, 128, 128\) .* layer 0 needs \(2, 64, 64\)"
    ):
        runner.forward(jnp.zeros((TOKEN_BUCKET, MINI.hidden_size)), batch, other)


def test_attention_inputs_with_another_head_count(runner_for):
    runner = runner_for("mini")
    batch = runner.batch(ForwardMode.EXTEND, [4], runner.alloc(1))
    attn = RadixLinearAttention(layer_id=0, num_heads=2, head_k_dim=64, head_v_dim=64, conv_size=4)
    q = jnp.zeros((4, 3, 64))
    with pytest.raises(ValueError, match=r"layer 0 has 2 heads; q, k, v, g, beta carry \(3, 3, 3, 3, 2\)"):
        attn(batch, q, q, q, q, jnp.zeros((4, 2)), jnp.zeros((8, 3, 384)), runner.pool)


@pytest.mark.parametrize(
    ("slot", "message"),
    [
        (NUM_SLOTS + 1, rf"slot {NUM_SLOTS + 1} is out of range: real slots are 1\.\.{NUM_SLOTS}"),
        (0, r"slot 0 is out of range"),
        (NUM_SLOTS, rf"slot {NUM_SLOTS} is not allocated"),
    ],
)
def test_slot_out_of_range_or_unallocated(slot, message, runner_for):
    runner = runner_for("mini")
    with pytest.raises(ValueError, match=message):
        runner.batch(ForwardMode.EXTEND, [4], [slot])


@pytest.mark.parametrize(
    ("mode", "seq_lens", "slots", "message"),
    [
        (ForwardMode.DECODE, [1, 2], [1, 2], r"exactly one token per request, got seq_lens \[1, 2\]"),
        (ForwardMode.EXTEND, [3, 4], [1], r"one entry per request: got 2, 1 and 2"),
        (ForwardMode.EXTEND, [3, -1], [1, 2], r"seq_lens \[3, -1\] and prefix_lens \[0, 0\] must be >= 0"),
        (ForwardMode.EXTEND, [], [], r"seq_lens must be a non-empty 1-D list"),
        (
            ForwardMode.IDLE,
            [1],
            [1],
            r"builds EXTEND, DECODE or TARGET_VERIFY batches, got <ForwardMode.IDLE",
        ),
    ],
)
def test_bad_batch_requests(mode, seq_lens, slots, message, runner_for):
    with pytest.raises(ValueError, match=message):
        make_forward_batch(runner_for("mini").backend, mode, seq_lens, slots, num_slots=NUM_SLOTS)


def test_a_non_kda_layer_index_is_refused():
    kimi = get_preset("kimi-linear-48b-a3b")
    with pytest.raises(ValueError, match=r"layer 3 is not a KDA layer of 'kimi-linear-48b-a3b'"):
        KimiDeltaAttention(kimi, 3, rngs=nnx.Rngs(0))  # 1-based layer 4 is an MLA layer
