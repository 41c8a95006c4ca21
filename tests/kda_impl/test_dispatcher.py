"""The kernel dispatcher: choice, forcing, fallback, and the gate routed to either implementation."""

from __future__ import annotations

import logging
import sys

import jax
import numpy as np
import pytest

import kda_impl.kernels as kernels
from kda_impl.kernels import naive
from kda_impl.kernels.common import kda_gate
from tests.kda_impl.kernel_inputs import random_kernel_inputs

FP32 = {"atol": 1e-5, "rtol": 1e-5}
NORMALISED = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}


@pytest.fixture
def fresh_dispatcher():
    """Forget cached import/probe results before and after the test."""
    caches = (kernels._pallas_module, kernels._pallas_lowering_failure, kernels._log_fallback_once)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_choice_comes_from_argument_then_environment(monkeypatch):
    monkeypatch.setenv(kernels.KERNEL_ENV, "naive")
    assert kernels.requested_kernel() == "naive"
    assert kernels.requested_kernel("pallas") == "pallas"
    monkeypatch.setenv(kernels.KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match=r"\$KDA_KERNEL='triton' is not one of"):
        kernels.resolve_kernel()
    with pytest.raises(ValueError, match="kernel argument='fast' is not one of"):
        kernels.resolve_kernel("fast")


def test_auto_is_plain_jax_off_tpu(monkeypatch):
    monkeypatch.delenv(kernels.KERNEL_ENV, raising=False)
    assert jax.default_backend() != "tpu"
    assert kernels.resolve_kernel() == "naive"
    assert kernels.resolve_kernel("pallas") == "pallas"  # forced: interpret mode here


def test_forced_pallas_matches_naive_through_the_dispatcher():
    inputs = random_kernel_inputs(np.random.default_rng(7), 20, dim=128)
    pallas_o, pallas_s = kernels.chunk_kda(**inputs, **NORMALISED, kernel="pallas")
    naive_o, naive_s = kernels.chunk_kda(**inputs, **NORMALISED, kernel="naive")
    np.testing.assert_allclose(np.asarray(pallas_o), np.asarray(naive_o), **FP32)
    np.testing.assert_allclose(np.asarray(pallas_s), np.asarray(naive_s), **FP32)


def test_unimportable_pallas_falls_back_once_with_the_reason(monkeypatch, fresh_dispatcher, caplog):
    monkeypatch.setitem(sys.modules, "kda_impl.kernels.pallas", None)  # makes the import fail
    monkeypatch.delattr(kernels, "pallas", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with caplog.at_level(logging.WARNING, logger="kda_impl.kernels"):
        assert kernels.resolve_kernel("auto") == "naive"
        assert kernels.resolve_kernel("auto") == "naive"
    fallback_lines = [r.message for r in caplog.records if "using plain JAX" in r.message]
    assert len(fallback_lines) == 1 and "cannot import kda_impl.kernels.pallas" in fallback_lines[0]
    with pytest.raises(RuntimeError, match="'pallas' was forced but is unavailable"):
        kernels.resolve_kernel("pallas")


PROBED_KERNELS = ("chunk_kda", "fused_recurrent_kda", "decode_kda_slots")


def stand_in_pallas_kernels(monkeypatch, failing: str | None) -> list[str]:
    """Replace the Pallas kernels the dispatcher probes on TPU by stand-ins that lower (there is no TPU to
    lower for here), except `failing`, whose lowering raises; returns the list of probed kernels."""
    from kda_impl.kernels import pallas

    probed: list[str] = []

    def stand_in(name: str):
        def kernel(q, *args, **kwargs):
            probed.append(name)
            if name == failing:
                raise RuntimeError("injected Mosaic failure")
            return q

        return kernel

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    for name in PROBED_KERNELS:
        monkeypatch.setattr(pallas, name, stand_in(name))
    return probed


def test_pallas_that_does_not_lower_falls_back(monkeypatch, fresh_dispatcher, caplog):
    """On a TPU where a Pallas kernel fails to lower (injected), auto takes plain JAX and logs the kernel
    and the reason once."""
    probed = stand_in_pallas_kernels(monkeypatch, failing="fused_recurrent_kda")
    with caplog.at_level(logging.WARNING, logger="kda_impl.kernels"):
        assert kernels.resolve_kernel("auto") == "naive"
        assert kernels.resolve_kernel("auto") == "naive"
    assert probed == ["chunk_kda", "fused_recurrent_kda"]  # probed once, stopping at the failure
    fallback_lines = [r.message for r in caplog.records if "using plain JAX" in r.message]
    assert fallback_lines == [
        "KDA kernels: using plain JAX (naive) instead of Pallas: fused_recurrent_kda does not lower on tpu: "
        "RuntimeError: injected Mosaic failure"
    ]
    assert kernels.resolve_kernel("pallas") == "pallas"  # forcing still takes Pallas


def test_pallas_that_lowers_is_chosen_on_tpu(monkeypatch, fresh_dispatcher, caplog):
    """On a TPU where every probe lowers, auto takes Pallas and logs nothing."""
    probed = stand_in_pallas_kernels(monkeypatch, failing=None)
    with caplog.at_level(logging.WARNING, logger="kda_impl.kernels"):
        assert kernels.resolve_kernel("auto") == "pallas"
    assert probed == list(PROBED_KERNELS)
    assert not [r for r in caplog.records if "using plain JAX" in r.message]


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
