"""The kernel dispatcher: choice, forcing, fallback, and the gate routed to either implementation."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_impl.kernels as kernels
from kda_impl.kernels import naive, pallas
from kda_impl.kernels.common import kda_gate
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from tests.kda_impl.kernel_inputs import random_kernel_inputs

FP32 = {"atol": 1e-5, "rtol": 1e-5}
NORMALISED = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}


@pytest.fixture
def fresh_dispatcher():
    """Forget cached import/probe results before and after the test."""
    caches = (kernels._pallas_module, kernels._log_fallback_once)
    for cache in caches:
        cache.cache_clear()
    kernels._probe_failures.clear()
    yield
    for cache in caches:
        cache.cache_clear()
    kernels._probe_failures.clear()


def fake_lowering(monkeypatch, max_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """Stand in for lowering a Pallas kernel on a TPU: a kernel lowers unless q's axis 1 (tokens, or for
    decode, heads) exceeds `max_tokens`, as a kernel whose VMEM blocks outgrow the chip would. Returns the
    list of (kernel, q shape) lowered."""
    lowered: list[tuple[str, tuple[int, ...]]] = []

    def lower(kernel: Callable, args: tuple, kwargs: dict) -> None:
        lowered.append((kernel.__name__, tuple(args[0].shape)))
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in args)  # shapes only: nothing runs
        if args[0].shape[1] > max_tokens:
            raise RuntimeError(f"Mosaic: VMEM exhausted at {args[0].shape[1]} rows")

    monkeypatch.setattr(kernels, "lower_pallas_kernel", lower)
    return lowered


def count_calls(monkeypatch, module, name: str, **extra) -> list[int]:
    """Wrap `module.name` so each call appends q's axis-1 length; returns that list."""
    calls: list[int] = []
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(q, *args, **kwargs):
        calls.append(np.shape(q)[1])
        return original(q, *args, **kwargs, **extra)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_choice_comes_from_argument_then_environment(monkeypatch):
    monkeypatch.setenv(kernels.KERNEL_ENV, "naive")
    assert kernels.requested_kernel() == "naive"
    assert kernels.requested_kernel("pallas") == "pallas"
    monkeypatch.setenv(kernels.KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match=r"\$KDA_KERNEL='triton' is not one of"):
        kernels.resolve_kernel()
    with pytest.raises(ValueError, match="kernel argument='fast' is not one of"):
        kernels.resolve_kernel("fast")


def test_auto_is_plain_jax_off_tpu_without_probing(monkeypatch, fresh_dispatcher):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    lowered = fake_lowering(monkeypatch, max_tokens=1 << 30)
    assert jax.default_backend() != "tpu" and not kernels.pallas_is_native()
    inputs = random_kernel_inputs(np.random.default_rng(1), 8)
    call = kernels.KernelCall("chunk_kda", tuple(inputs.values()))
    assert kernels.resolve_kernel(None, call) == "naive"
    kernels.chunk_kda(**inputs)
    assert lowered == []
    assert kernels.resolve_kernel("pallas", call) == "pallas"  # forced: interpret mode here


def test_kernel_choice_says_how_the_kernels_run(monkeypatch, fresh_dispatcher):
    """Never a plain `pallas`: off a TPU Pallas runs in its interpreter, on a TPU compiled by Mosaic."""
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    assert kernels.kernel_choice("pallas") == "pallas (interpret, cpu)"
    assert kernels.kernel_choice("naive") == kernels.kernel_choice("auto") == "naive (xla, cpu)"
    monkeypatch.setattr(kernels, "pallas_is_native", lambda: True)  # a TPU, stood in for
    assert kernels.kernel_choice("pallas") == kernels.kernel_choice("auto") == "pallas (mosaic, cpu)"


def test_forced_pallas_matches_naive_through_the_dispatcher():
    inputs = random_kernel_inputs(np.random.default_rng(7), 20, dim=128)
    pallas_o, pallas_s = kernels.chunk_kda(**inputs, **NORMALISED, kernel="pallas")
    naive_o, naive_s = kernels.chunk_kda(**inputs, **NORMALISED, kernel="naive")
    np.testing.assert_allclose(np.asarray(pallas_o), np.asarray(naive_o), **FP32)
    np.testing.assert_allclose(np.asarray(pallas_s), np.asarray(naive_s), **FP32)


def test_unimportable_pallas_falls_back_once_with_the_reason(monkeypatch, fresh_dispatcher, caplog):
    monkeypatch.setitem(sys.modules, "kda_impl.kernels.pallas", None)  # makes the import fail
    monkeypatch.delattr(kernels, "pallas", raising=False)
    monkeypatch.setattr(kernels, "pallas_is_native", lambda: True)
    with caplog.at_level(logging.WARNING, logger="kda_impl.kernels"):
        assert kernels.resolve_kernel("auto") == "naive"
        assert kernels.resolve_kernel("auto") == "naive"
    fallback_lines = [r.message for r in caplog.records if "using plain JAX" in r.message]
    assert len(fallback_lines) == 1 and "cannot import kda_impl.kernels.pallas" in fallback_lines[0]
    with pytest.raises(RuntimeError, match="'pallas' was forced but is unavailable"):
        kernels.resolve_kernel("pallas")


def test_auto_probes_pallas_at_each_calls_shapes_once(monkeypatch, fresh_dispatcher, caplog):
    """On a TPU (stood in for) whose Pallas chunk kernel lowers at 16 tokens but not at 64, auto runs
    Pallas at 16 and plain JAX at 64, lowers each shape once, logs the fallback once, and the backend's
    `kernel_used` (the report's) names the shape that fell back."""
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernels, "pallas_is_native", lambda: True)
    lowered = fake_lowering(monkeypatch, max_tokens=32)
    rng = np.random.default_rng(5)
    small, large = random_kernel_inputs(rng, 16), random_kernel_inputs(rng, 64)
    expected = [naive.chunk_kda(**inputs, **NORMALISED) for inputs in (small, large)]
    pallas_calls = count_calls(monkeypatch, pallas, "chunk_kda", interpret=True)
    naive_calls = count_calls(monkeypatch, naive, "chunk_kda")
    with caplog.at_level(logging.WARNING, logger="kda_impl.kernels"):
        for inputs, (expected_o, expected_state) in [*zip((small, large), expected)] * 2:
            o, state = kernels.chunk_kda(**inputs, **NORMALISED)
            np.testing.assert_allclose(np.asarray(o), np.asarray(expected_o), **FP32)
            np.testing.assert_allclose(np.asarray(state), np.asarray(expected_state), **FP32)
    assert pallas_calls == [16, 16]
    assert naive_calls == [64, 64]
    assert lowered == [("chunk_kda", (1, 16, 2, 32)), ("chunk_kda", (1, 64, 2, 32))]
    fallback_lines = [r.message for r in caplog.records if "using plain JAX" in r.message]
    assert len(fallback_lines) == 1
    assert fallback_lines[0].startswith(
        "KDA kernels: using plain JAX (naive) instead of Pallas: "
        "chunk_kda(float32[1,64,2,32], float32[1,64,2,32], float32[1,64,2,32], float32[1,64,2,32], "
        "float32[1,64,2], output_final_state=True, use_qk_l2norm_in_kernel=True) "
    )
    assert fallback_lines[0].endswith(
        "does not lower on cpu: RuntimeError: Mosaic: VMEM exhausted at 64 rows"
    )
    options = dict(NORMALISED)  # as dispatched
    small_call = kernels.KernelCall("chunk_kda", tuple(small.values()), options)
    large_call = kernels.KernelCall("chunk_kda", tuple(large.values()), options)
    assert kernels.resolve_kernel("auto", small_call) == "pallas"
    assert kernels.resolve_kernel("auto", large_call) == "naive"
    assert kernels.resolve_kernel("pallas", large_call) == "pallas"  # forcing still takes Pallas
    used = KDAAttnBackend(kernel=None).kernel_used
    assert used.startswith("pallas (mosaic, cpu), naive (xla, cpu) for chunk_kda(float32[1,64,2,32]")
    assert "[1,16," not in used
    assert len(lowered) == 2


def test_probe_key_is_shapes_dtypes_and_static_options(monkeypatch, fresh_dispatcher):
    """A new batch size, dtype or static option is probed anew; a new layer index (a runtime value) or new
    values of the same shapes are not."""
    monkeypatch.setattr(kernels, "pallas_is_native", lambda: True)
    lowered = fake_lowering(monkeypatch, max_tokens=1 << 30)
    rng = np.random.default_rng(2)

    def decode_call(batch: int, dtype=np.float32, layer: int = 0, **options) -> kernels.KernelCall:
        step = [x[:, 0].astype(dtype) for x in random_kernel_inputs(rng, 1, batch=batch).values()]
        pool = jnp.zeros((3, 2 * batch + 1, 2, 32, 32), jnp.float32)
        slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
        kwargs = {"state_buffer": pool, "slot_indices": slots, "layer_index": layer, **options}
        return kernels.KernelCall("decode_kda_slots", tuple(step), kwargs)

    calls = [
        decode_call(2),
        decode_call(2, layer=1),  # same key: the layer index is lowered as an i32[] argument
        decode_call(2, layer=2),
        decode_call(4),
        decode_call(2, dtype=jnp.bfloat16),
        decode_call(2, scale=0.5),
        decode_call(2, scale=np.float32(0.5)),  # same option as a numpy scalar: same key
    ]
    assert [kernels.resolve_kernel("auto", call) for call in calls] == ["pallas"] * len(calls)
    assert [shape for _, shape in lowered] == [(2, 2, 32), (4, 2, 32), (2, 2, 32), (2, 2, 32)]
    unhashable = kernels.KernelCall("decode_kda_slots", (), {"scale": {"per_head": 0.5}})
    with pytest.raises(ValueError, match=r"^scale=\{'per_head': 0.5\} is neither an array nor a hashable"):
        kernels.resolve_kernel("auto", unhashable)


def test_probe_lowers_the_real_pallas_kernels_at_the_calls_shapes(monkeypatch, fresh_dispatcher):
    """The probe's own lowering (no stand-in) of each Pallas kernel at a call's arguments: arrays become
    shapes, options stay static. Here (CPU) Pallas lowers in interpret mode, so each probe passes."""
    monkeypatch.setattr(kernels, "pallas_is_native", lambda: True)
    rng = np.random.default_rng(4)
    inputs = random_kernel_inputs(rng, 24)
    gate = {
        "use_gate_in_kernel": True,
        "A_log": np.zeros(2, np.float32),
        "dt_bias": np.zeros((2, 32), np.float32),
    }
    step = tuple(x[:, 0] for x in random_kernel_inputs(rng, 1, batch=2).values())
    decode = {
        "state_buffer": np.zeros((2, 5, 2, 32, 32), np.float32),
        "slot_indices": np.array([3, 0], np.int32),
        "layer_index": 1,
        "scale": 0.25,
    }
    calls = [
        kernels.KernelCall("chunk_kda", tuple(inputs.values()), {**gate, **NORMALISED}),
        kernels.KernelCall("fused_recurrent_kda", tuple(inputs.values()), {"initial_state": None}),
        kernels.KernelCall("decode_kda_slots", step, decode),
    ]
    assert [kernels.resolve_kernel("auto", call) for call in calls] == ["pallas"] * 3
    assert list(kernels._probe_failures.values()) == [""] * 3


def test_gate_in_kernel_equals_precomputed_gate_on_both_paths():
    rng = np.random.default_rng(3)
    inputs = random_kernel_inputs(rng, 24, dim=128)
    raw = rng.standard_normal(inputs["g"].shape).astype(np.float32) * 3
    a_log = np.log(rng.uniform(1, 16, size=2)).astype(np.float32)
    dt_bias = rng.standard_normal((2, 128)).astype(np.float32)
    g = kda_gate(raw, a_log[:, None], dt_bias)
    expected, _ = naive.chunk_kda(**{**inputs, "g": g}, **NORMALISED)
    for kernel in ("naive", "pallas"):
        o, _ = kernels.chunk_kda(
            **{**inputs, "g": raw},
            **NORMALISED,
            use_gate_in_kernel=True,
            A_log=a_log,
            dt_bias=dt_bias,
            kernel=kernel,
        )
        np.testing.assert_allclose(np.asarray(o), np.asarray(expected), **FP32)
    with pytest.raises(ValueError, match="only used with use_gate_in_kernel=True"):
        kernels.chunk_kda(**inputs, A_log=a_log, kernel="naive")
    integer_gate = {**inputs, "g": raw.astype(np.int32)}
    for kernel in ("naive", "pallas"):  # an integer raw gate is refused on both paths, before the gate
        with pytest.raises(ValueError, match=r"^g must be a floating-point array, got dtype int32$"):
            kernels.chunk_kda(**integer_gate, use_gate_in_kernel=True, A_log=a_log, kernel=kernel)
