"""The sglang-jax adapter's serving path (examples/sglang_jax/adapter.py) on sglang-jax's own pool.

Needs a sglang-jax checkout (`$SGLANG_JAX`); without one the checkout's tests skip with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from conformance.adapter import provided_calls
from conformance.checks.catalogue import CheckSkipped
from conformance.checks.runner import CheckRunner
from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_events import Accept, Copy, alloc, decode, extend, free, verify
from conformance.checks.serving_scenarios import Scenario
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from examples.sglang_jax.adapter import _bucket
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

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


def _adapter(**options: str):
    from examples.sglang_jax.adapter import SglangJaxAdapter

    return SglangJaxAdapter(
        CONFIG,
        synthetic_weights(CONFIG, seed=3),
        "fp32",
        options=SglangJaxAdapter.parse_options({"sglang_jax": os.environ["SGLANG_JAX"], **options}),
    )


class _CopySlotsSpy:
    """Wraps sgl_jax's `RecurrentStatePool.copy_slots`, recording the (src, dst) index shapes it is
    traced with."""

    def __init__(self, original):
        self.original, self.calls = original, []

    def __get__(self, pool, owner):
        def call(src, dst):
            self.calls.append((src.shape, dst.shape))
            return self.original(pool, src, dst)

        return call


@needs_checkout
@pytest.mark.parametrize("track_interval", [None, "4"])
def test_serving_copy_goes_through_sgl_jax_copy_slots(monkeypatch, track_interval) -> None:
    adapter = _adapter(**({} if track_interval is None else {"track_interval": track_interval}))
    pool_class = adapter._sgl.RecurrentStatePool
    spy = _CopySlotsSpy(pool_class.copy_slots)
    monkeypatch.setattr(pool_class, "copy_slots", spy)
    rng = np.random.default_rng(1)
    tokens = rng.standard_normal((5, CONFIG.hidden_size)).astype(np.float32)
    adapter.serving_open(3)
    source, snapshot = adapter.serving_alloc(), adapter.serving_alloc()
    adapter.serving_forward("extend", tokens[:4], np.array([4]), np.array([source]), np.zeros(1, np.int64), 0)
    at_boundary = adapter.serving_state(source)
    track_slot = adapter._snapshot_slot(source)
    assert (track_slot != source) == (track_interval is not None)  # a snapshot published at 4 tokens
    adapter.serving_copy(source, snapshot)
    assert spy.calls == [((1,), (1,))]
    for copied, expected in zip(adapter.serving_state(snapshot), at_boundary, strict=True):
        np.testing.assert_array_equal(copied, expected)
    # the source goes on past the boundary; its track slot keeps the boundary's states
    adapter.serving_forward("decode", tokens[4:], np.array([1]), np.array([source]), np.array([4]), 0)
    assert adapter._snapshot_slot(source) == source  # its current states are not a boundary's
    if track_interval is not None:
        for kept, expected in zip(adapter.serving_state(track_slot), at_boundary, strict=True):
            np.testing.assert_array_equal(kept, expected)
    after = adapter.serving_state(source)
    assert not np.array_equal(after[0], at_boundary[0])
    adapter.serving_copy(source, snapshot)  # the same shapes: the jitted copy is not traced again
    for copied, expected in zip(adapter.serving_state(snapshot), after, strict=True):
        np.testing.assert_array_equal(copied, expected)


@needs_checkout
def test_serving_load_writes_the_slot_and_no_other() -> None:
    adapter = _adapter()
    adapter.serving_open(2)
    slot, other = adapter.serving_alloc(), adapter.serving_alloc()
    rng = np.random.default_rng(2)
    recurrent = rng.standard_normal((CONFIG.num_heads, CONFIG.head_dim, CONFIG.head_dim)).astype(np.float32)
    conv = rng.standard_normal((CONFIG.conv_size - 1, 3 * CONFIG.proj_dim)).astype(np.float32)
    before = adapter.serving_state(other)
    adapter.serving_load(slot, recurrent, conv)
    np.testing.assert_array_equal(adapter.serving_state(slot)[0], recurrent)
    np.testing.assert_array_equal(adapter.serving_state(slot)[1], conv)
    for a, b in zip(before, adapter.serving_state(other), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="conv has shape"):
        adapter.serving_load(slot, recurrent, conv.T)


INTERVAL = 8
#: the fixed `prefix-hit` scenario at a small interval: a prompt of 2i + 2 tokens prefilled in chunks of
#: i, i, 2 with snapshots after i and 2i, an unaligned hit from 2i and a page-aligned one from i
PREFIX_HIT = [
    *alloc("p", "s1", "s2"), extend(("p", INTERVAL)), Copy("p", "s1"), extend(("p", INTERVAL)),
    Copy("p", "s2"), extend(("p", 2)), decode("p"), *free("p"),
    *alloc("q"), Copy("s2", "q"), extend(("q", 3)),
    *alloc("r"), Copy("s1", "r"), extend(("r", 5), ("q", 1)), decode("r", "q"),
]  # fmt: skip


@needs_checkout
@pytest.mark.parametrize("track_interval", [None, str(INTERVAL)])
def test_a_prefix_hit_scenario_runs_on_sgl_jax_and_the_verify_scenarios_skip(
    monkeypatch, track_interval
) -> None:
    from examples.sglang_jax.adapter import SglangJaxAdapter

    from_track_slot = []  # per serving_copy: whether it copied from the source's track slot
    snapshot_slot = SglangJaxAdapter._snapshot_slot

    def spy(adapter, slot: int) -> int:
        source = snapshot_slot(adapter, slot)
        from_track_slot.append(source != slot)
        return source

    monkeypatch.setattr(SglangJaxAdapter, "_snapshot_slot", spy)

    assert {"serving_copy", "serving_load"} <= provided_calls(SglangJaxAdapter)
    assert "serving_accept" not in provided_calls(SglangJaxAdapter)
    options = {"sglang_jax": os.environ["SGLANG_JAX"]}
    if track_interval is not None:
        options["track_interval"] = track_interval
    runner = CheckRunner(DumpSet(str(GOLDEN)), SglangJaxAdapter, "auto", TolerancePolicy.load(), options)
    scenarios = [
        Scenario("short-prefix-hit", 4, tuple(PREFIX_HIT)),
        Scenario("short-verify", 2, (*alloc("v"), extend(("v", 3)), verify(("v", 2)), Accept("v", 1))),
    ]
    found = {}
    serving = ServingChecks(runner, scenarios, "short")
    for spec in serving.plan(["fp32"]):
        try:
            found[spec.check] = "passed" if serving.run(spec).comparison.passed else "failed"
        except CheckSkipped as skip:
            found[spec.check] = f"skipped: {skip}"
    hit = {check: result for check, result in found.items() if "prefix-hit" in check}
    assert {"serving-short-prefix-hit", "serving-short-prefix-hit-state"} <= set(hit)
    assert set(hit.values()) == {"passed"}, found
    # the snapshots after i and 2i tokens are the published track slots; the hits copy the snapshots
    assert from_track_slot == [track_interval is not None] * 2 + [False] * 2
    assert (
        found["serving-short-verify"].startswith("skipped:")
        and "serving_accept" in found["serving-short-verify"]
    )
