"""The sglang-jax adapter's serving path (examples/sglang_jax/adapter.py) on sglang-jax's own pool.

Needs a sglang-jax checkout (`$SGLANG_JAX`); without one the checkout's tests skip with the reason.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from examples.sglang_jax.adapter import _bucket
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights

CONFIG = get_preset("mini").replace(hidden_size=32, head_dim=8)
needs_checkout = pytest.mark.skipif(
    not os.environ.get("SGLANG_JAX"), reason="no sglang-jax checkout: set SGLANG_JAX=/path/to/sglang-jax"
)


def test_batches_pad_to_powers_of_two_above_a_minimum() -> None:
    assert [_bucket(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, 16]
    assert _bucket(100, 16) == 128


@needs_checkout
def test_a_recycled_slot_starts_from_zeros_and_padding_touches_no_slot() -> None:
    from examples.sglang_jax.adapter import SglangJaxAdapter

    adapter = SglangJaxAdapter(
        CONFIG,
        synthetic_weights(CONFIG, seed=3),
        "fp32",
        options=SglangJaxAdapter.parse_options({"sglang_jax": os.environ["SGLANG_JAX"]}),
    )
    rng = np.random.default_rng(0)
    first, second, bystander = (
        rng.standard_normal((n, CONFIG.hidden_size)).astype(np.float32) for n in (5, 3, 4)
    )
    adapter.serving_open(2)
    slot, other = adapter.serving_alloc(), adapter.serving_alloc()
    assert {slot, other} == {1, 2}  # sglang-jax's free list: slot 0 is the dummy
    ones = np.ones(1, np.int64)
    adapter.serving_forward("extend", bystander, np.array([4]), np.array([other]), np.zeros(1, np.int64), 0)
    adapter.serving_forward("extend", first, np.array([5]), np.array([slot]), np.zeros(1, np.int64), 0)
    before = adapter.serving_state(other)
    adapter.serving_free(slot)
    recycled = adapter.serving_alloc()
    assert recycled == slot
    padded = np.concatenate([second, np.zeros((2, CONFIG.hidden_size), np.float32)])
    out = adapter.serving_forward("extend", padded, np.array([3]), np.array([recycled]), 0 * ones, 2)
    alone = adapter.layer_extend(second, np.array([0, 3]))
    np.testing.assert_allclose(out[:3], alone.out, rtol=1e-5, atol=1e-6)
    recurrent, conv = adapter.serving_state(recycled)
    np.testing.assert_allclose(recurrent, alone.final_state[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conv, alone.intermediates["final_conv_state"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(before, adapter.serving_state(other), strict=True):
        np.testing.assert_array_equal(a, b)
