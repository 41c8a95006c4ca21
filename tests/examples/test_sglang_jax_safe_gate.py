"""examples/sglang_jax/safe_gate.py: what sglang-jax's `safe_gate` does without a `lower_bound` (issue 42).

The traced-program test needs a sglang-jax checkout (`$SGLANG_JAX`); without one it skips with the reason.
"""

from __future__ import annotations

import importlib
import os

import pytest

from examples.sglang_jax import safe_gate as script

needs_checkout = pytest.mark.skipif(
    not os.environ.get("SGLANG_JAX"), reason="no sglang-jax checkout: set SGLANG_JAX=/path/to/sglang-jax"
)


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="variant must be one of"), script.backend_call("safe_gate=None"):
        pass


@needs_checkout
def test_safe_gate_does_not_change_the_traced_program() -> None:
    """At cddbf6f the flag reaches the intra-chunk Pallas kernel, which never reads it."""
    assert script.traced_programs_equal(os.environ["SGLANG_JAX"], tokens=64)


@needs_checkout
def test_the_comparison_sees_a_changed_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same comparison tells programs apart when `safe_gate` does change the call (here: a bound)."""
    script.import_sgl_jax(os.environ["SGLANG_JAX"])
    script.stub_server_modules()
    kda = importlib.import_module("sgl_jax.srt.kernels.kda")
    original = kda.chunk_kda

    def bounded_when_safe(*args, safe_gate: bool, **kwargs):
        return original(*args, **kwargs, lower_bound=-5.0 if safe_gate else None)

    monkeypatch.setattr(kda, "chunk_kda", bounded_when_safe)
    assert not script.traced_programs_equal(os.environ["SGLANG_JAX"], tokens=64)
