"""Serving invariances through the pool (fp32, atol = rtol = 1e-5), the ForwardMode dispatch, the short conv,
the batch bucketing and the built-in conformance adapter.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from kda_impl.layers.short_conv import short_conv_with_state
from kda_impl.mem_cache.recurrent_state_pool import DUMMY_SLOT
from kda_impl.model_executor.forward_batch import ForwardMode, make_forward_batch
from kda_impl.models.kimi_linear import KimiDeltaAttention
from kda_spec.synthetic_weights import synthetic_weights
from tests.kda_impl.conftest import CONFIGS, NUM_SLOTS, assert_close, random_states, random_tokens

SEQ_LEN = 100  # crosses a 64-token chunk boundary


def one_prefill(runner, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Output and (recurrent, conv) states of one request prefilled in one step."""
    slots = runner.alloc(1)
    out = runner.extend([x], slots).outs[0]
    states = runner.states(slots)
    runner.free(slots)
    return out, states


def assert_as_one_prefill(runner, outs: list[np.ndarray], slots: list[int], expected) -> None:
    """`outs` (concatenated) and the states left in `slots` equal one prefill's `expected` (out, states)."""
    expected_out, expected_states = expected
    assert_close(np.concatenate(outs), expected_out)
    for state, expected_state in zip(runner.states(slots), expected_states):
        assert_close(state, expected_state)


# How one SEQ_LEN-token request is served: its EXTEND segments' lengths; the tokens after them are decoded
# one at a time. A 2-token first segment leaves fewer tokens than the conv window.
SCHEDULES = {
    "1-decode": (99,),
    "8-decodes": (92,),
    "16-decodes": (84,),
    "chunked-2": (2, 98),
    "chunked-64": (64, 36),
    "chunked-70": (70, 30),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_served_in_steps_matches_one_prefill(schedule, runner_for):
    runner = runner_for("mini")
    x = random_tokens(np.random.default_rng(10 + list(SCHEDULES).index(schedule)), runner.config, SEQ_LEN)
    expected = one_prefill(runner, x)

    slots = runner.alloc(1)
    bounds = np.cumsum([0, *SCHEDULES[schedule]])
    outs = [runner.extend([x[start:end]], slots).outs[0] for start, end in itertools.pairwise(bounds)]
    outs += [runner.decode(x[t : t + 1], slots) for t in range(bounds[-1], SEQ_LEN)]
    assert_as_one_prefill(runner, outs, slots, expected)


def test_requests_in_different_slots_do_not_disturb_each_other(runner_for):
    runner = runner_for("mini")
    rng = np.random.default_rng(30)
    xa, xb = random_tokens(rng, runner.config, 40), random_tokens(rng, runner.config, 70)
    decode_a, decode_b = random_tokens(rng, runner.config, 3), random_tokens(rng, runner.config, 3)

    # A alone.
    alone = runner.alloc(1)
    alone_outs = [runner.extend([xa], alone).outs[0]]
    alone_outs += [runner.decode(decode_a[i : i + 1], alone) for i in range(3)]
    alone_states = runner.states(alone)

    # A next to B: packed in one prefill, then decoded together, then B decoded alone.
    a, b = runner.alloc(2)
    together_outs = [runner.extend([xa, xb], [a, b]).outs[0]]
    for i in range(3):
        together_outs.append(runner.decode(np.stack([decode_a[i], decode_b[i]]), [a, b])[:1])
    a_states = runner.states([a])
    for i in range(2):
        runner.decode(decode_b[i : i + 1], [b])

    assert_close(np.concatenate(together_outs), np.concatenate(alone_outs))
    for state, expected in zip(runner.states([a]), alone_states):
        assert_close(state, expected)
    for state, before in zip(runner.states([a]), a_states):
        np.testing.assert_array_equal(state, before)  # B's steps never touched A's slot


def test_freed_slot_is_reused_clean(runner_for):
    runner = runner_for("mini")
    rng = np.random.default_rng(40)
    x = random_tokens(rng, runner.config, 50)
    expected = one_prefill(runner, x)

    used = runner.alloc(1)
    runner.extend([random_tokens(rng, runner.config, 90)], used)
    assert np.any(runner.states(used)[0])
    runner.free(used)
    reused = runner.alloc(1)
    assert reused == used
    assert not np.any(runner.states(reused)[0]) and not np.any(runner.states(reused)[1])
    assert_as_one_prefill(runner, runner.extend([x], reused).outs, reused, expected)


def test_idle_returns_zeros_and_leaves_the_pool_alone(runner_for):
    runner = runner_for("mini")
    rng = np.random.default_rng(50)
    slots = runner.alloc(2)
    runner.extend([random_tokens(rng, runner.config, 30), random_tokens(rng, runner.config, 9)], slots)
    before = [np.asarray(buffer) for buffer in (runner.pool.recurrent_buffer, runner.pool.conv_buffer)]

    batch = runner.batch(ForwardMode.EXTEND, [5, 7], slots).replace(forward_mode=ForwardMode.IDLE)
    step = runner.run(batch, [random_tokens(rng, runner.config, 5), random_tokens(rng, runner.config, 7)])
    assert not np.any(np.concatenate(step.outs))
    np.testing.assert_array_equal(np.asarray(runner.pool.recurrent_buffer), before[0])
    np.testing.assert_array_equal(np.asarray(runner.pool.conv_buffer), before[1])


@pytest.mark.parametrize(
    ("mode", "error", "message"),
    [
        (
            ForwardMode.DRAFT_EXTEND,
            NotImplementedError,
            "DRAFT_EXTEND: a draft model's extend is not supported",
        ),
        (
            ForwardMode.TARGET_VERIFY,
            ValueError,
            r"TARGET_VERIFY needs the pool's draft buffers: RecurrentStatePool.with_draft_tokens\(k\) first",
        ),
        (ForwardMode.MIXED, ValueError, "MIXED: never reaches a linear-recurrent backend"),
    ],
)
def test_unsupported_modes_raise(mode, error, message, runner_for):
    runner = runner_for("mini")
    slots = runner.alloc(1)
    batch = runner.batch(ForwardMode.EXTEND, [4], slots).replace(forward_mode=mode)
    with pytest.raises(error, match=message):
        runner.run(batch, [np.zeros((4, runner.config.hidden_size), np.float32)])


def test_forward_is_jitted_once_per_bucket_with_the_pool_donated(runner_for, monkeypatch):
    runner = runner_for("mini")
    rng = np.random.default_rng(60)
    slots = runner.alloc(3)
    traces = []  # the layer's Python body runs only while jit traces it
    layer_call = KimiDeltaAttention.__call__

    def counted(self, *args, **kwargs):
        traces.append(1)
        return layer_call(self, *args, **kwargs)

    monkeypatch.setattr(KimiDeltaAttention, "__call__", counted)
    # Traced (or cached) here; the second call sees the pool as the jitted forward returns it (its
    # sharding may differ from a freshly created pool's, which is a new trace once).
    for length in (10, 5):
        runner.extend([random_tokens(rng, runner.config, length)], slots[:1])
    traced = len(traces)
    old_pool = runner.pool
    # other lengths in the same bucket (T <= 64, N <= 8): no new trace
    runner.extend([random_tokens(rng, runner.config, n) for n in (33, 1, 20)], slots)
    assert len(traces) == traced
    assert old_pool.recurrent_buffer.is_deleted() and old_pool.conv_buffer.is_deleted()


def test_short_conv_keeps_sequences_apart():
    """The packed conv equals a loop per sequence over [state | own tokens], zero-length ones included."""
    rng = np.random.default_rng(70)
    width, channels, lengths = 4, 6, [3, 0, 1, 7, 2]
    x = rng.standard_normal((sum(lengths), channels)).astype(np.float32)
    weight = rng.standard_normal((width, channels)).astype(np.float32)
    state = rng.standard_normal((len(lengths), width - 1, channels)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    y, new_state = jax.jit(short_conv_with_state)(x, weight, state, cu)

    for n, (start, end) in enumerate(itertools.pairwise(cu)):
        history = np.concatenate([state[n], x[start:end]])  # [W-1 + L, C]
        expected = [np.sum(weight * history[t : t + width], axis=0) for t in range(end - start)]
        np.testing.assert_allclose(
            np.asarray(y)[start:end], np.reshape(expected, (-1, channels)), rtol=1e-6, atol=1e-6
        )
        np.testing.assert_array_equal(np.asarray(new_state)[n], history[-(width - 1) :])


def test_batches_are_padded_to_buckets_with_the_dummy_slot(runner_for):
    backend = runner_for("mini").backend
    batch = make_forward_batch(
        backend, ForwardMode.EXTEND, [5, 60, 2], [3, 1, 2], num_slots=NUM_SLOTS, prefix_lens=[0, 4, 10]
    )
    metadata = batch.attn_backend.forward_metadata
    assert batch.num_tokens == 128 and batch.batch_size == 8
    np.testing.assert_array_equal(metadata.cu_q_lens, [0, 5, 65, 67, 128, 128, 128, 128, 128])
    np.testing.assert_array_equal(metadata.recurrent_indices, [3, 1, 2] + [DUMMY_SLOT] * 5)
    positions = np.asarray(batch.positions)
    np.testing.assert_array_equal(positions[:8], [0, 1, 2, 3, 4, 4, 5, 6])
    np.testing.assert_array_equal(positions[65:], [10, 11] + [0] * 61)

    decode = make_forward_batch(backend, ForwardMode.DECODE, [1] * 9, list(range(1, 10)), num_slots=NUM_SLOTS)
    assert decode.num_tokens == decode.batch_size == 16
    np.testing.assert_array_equal(decode.attn_backend.forward_metadata.cu_q_lens, np.arange(17))
    assert (
        batch.attn_backend is not backend and backend.forward_metadata is None
    )  # batches never share metadata


def test_conformance_adapter_drives_the_serving_path():
    """The built-in adapter: extend with initial states, carry into decode, the kernel entry points."""
    config = CONFIGS["mini"]
    adapter = KDAImplAdapter(config, synthetic_weights(config, seed=0), "fp32", kernel="naive")
    rng = np.random.default_rng(80)
    lengths = [5, 17, 1, 36]  # both prefills below fit the 64-token bucket: one compilation
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = random_tokens(rng, config, sum(lengths) + len(lengths))
    prefix, steps = x[: cu[-1]], x[cu[-1] :]
    initial = random_states(rng, config, len(lengths))

    full = adapter.layer_extend(prefix, cu, initial_state=initial)
    assert full.out.shape == (cu[-1], config.hidden_size) and full.final_state.shape == initial.shape
    assert set(full.intermediates) >= {"q_after_conv", "g", "beta", "g_out", "o_norm", "final_conv_state"}
    decoded = adapter.layer_decode(steps, full.carry)

    # The same tokens as one longer prefill per sequence.
    pieces = [[prefix[start:end], steps[i : i + 1]] for i, (start, end) in enumerate(itertools.pairwise(cu))]
    longer = np.concatenate([piece for pair in pieces for piece in pair])
    longer_cu = cu + np.arange(len(cu), dtype=np.int32)
    reference = adapter.layer_extend(longer, longer_cu, initial_state=initial)
    assert_close(decoded.out, reference.out[longer_cu[1:] - 1])
    assert_close(decoded.final_state, reference.final_state)
    assert adapter.kernel_used == "naive (xla, cpu)"

    # Kernel entry points: chunk and token-recurrent agree on l2-normalised inputs.
    heads, dim = config.num_heads, config.head_dim
    q, k = (rng.standard_normal((cu[-1], heads, dim)).astype(np.float32) for _ in range(2))
    q, k = (u / np.sqrt(np.sum(u * u, axis=-1, keepdims=True) + 1e-6) for u in (q, k))
    v = rng.standard_normal((cu[-1], heads, dim)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (cu[-1], heads, dim)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (cu[-1], heads)).astype(np.float32)
    o_chunk, s_chunk = adapter.chunk_kernel(q, k, v, g, beta, cu, initial)
    o_rec, s_rec = adapter.recurrent_kernel(q, k, v, g, beta, cu, initial)
    assert_close(o_chunk, o_rec)
    assert_close(s_chunk, s_rec)
