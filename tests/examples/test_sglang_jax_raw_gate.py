"""The sglang-jax adapter's raw-gate kernels (issue 42): `chunk_kda_fwd` with the gate in the kernel, as
its `KDAAttnBackend` calls it, and its decode path (`_fused_kda_gate`, then the naive recurrence).

The runs need a sglang-jax checkout (`$SGLANG_JAX`); without one they skip with the reason.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from conformance.adapter import RawGateKernelAdapter, protocol_error, provided_calls, unserved_family
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import RAW_GATE_KERNEL_TRUTH_SOURCE, CheckRunner
from conformance.dumps.bundled import bundled_golden
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from examples.sglang_jax.adapter import SglangJaxAdapter
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
needs_checkout = pytest.mark.skipif(
    not os.environ.get("SGLANG_JAX"), reason="no sglang-jax checkout: set SGLANG_JAX=/path/to/sglang-jax"
)


def test_the_adapter_declares_the_raw_gate_protocol_for_kimi_linear_only() -> None:
    assert issubclass(SglangJaxAdapter, RawGateKernelAdapter)
    assert protocol_error(SglangJaxAdapter) is None
    assert {"chunk_kernel_raw_gate", "recurrent_kernel_raw_gate"} <= provided_calls(SglangJaxAdapter)
    assert frozenset({"kimi-linear"}) == SglangJaxAdapter.FAMILIES
    glm = get_preset("glm5-next-mini")
    assert unserved_family(SglangJaxAdapter, glm) is not None  # every check of a GLM set skips


@needs_checkout
def test_sglang_jax_passes_the_raw_gate_checks_on_golden_t8() -> None:
    runner = CheckRunner(
        DumpSet(str(bundled_golden())),
        SglangJaxAdapter,
        "auto",
        TolerancePolicy.load(),
        {"sglang_jax": os.environ["SGLANG_JAX"]},
    )
    for kind in kinds.RAW_GATE_KERNEL_KINDS:
        comparison = runner.run(CheckSpec("T8", "fp32", Check(kind))).comparison
        assert comparison.passed, (kind, comparison.verdict)
        assert comparison.attribution.source == RAW_GATE_KERNEL_TRUTH_SOURCE


def _adapter(dtype: str) -> SglangJaxAdapter:
    config = get_preset("mini")
    return SglangJaxAdapter(
        config,
        synthetic_weights(config, seed=0),
        dtype,
        options=SglangJaxAdapter.parse_options({"sglang_jax": os.environ["SGLANG_JAX"]}),
    )


@needs_checkout
def test_its_bf16_decode_gate_is_rounded_to_bf16() -> None:
    """The finding of examples/sglang_jax/README.md: `_fused_kda_gate` returns the gate in the raw gate's
    dtype, so in a bf16 run the recurrence decays by a bf16-rounded g (the reference keeps it fp32)."""
    adapter = _adapter("bf16")
    heads, dim, tokens = adapter.config.num_heads, adapter.config.head_dim, 6
    rng = np.random.default_rng(0)
    q, k, v, g_raw = (rng.standard_normal((tokens, heads, dim)).astype(np.float32) for _ in range(4))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    g_raw = np.asarray(jnp.asarray(g_raw).astype(jnp.bfloat16), np.float32)  # bf16 values, as dumped
    beta = rng.uniform(0.1, 0.9, (tokens, heads)).astype(np.float32)
    a_log, dt_bias = (
        rng.uniform(-1, 1, heads).astype(np.float32),
        rng.standard_normal(heads * dim).astype(np.float32),
    )
    gate = -np.exp(a_log)[:, None] * np.logaddexp(0, g_raw + dt_bias.reshape(heads, dim))
    cu = np.array([0, tokens])
    _, state = adapter.recurrent_kernel_raw_gate(q, k, v, g_raw, beta, a_log, dt_bias, None, cu, None)
    bf16_gate = np.asarray(jnp.asarray(gate, jnp.float32).astype(jnp.bfloat16), np.float32)
    _, state_bf16_gate = adapter.recurrent_kernel(q, k, v, bf16_gate, beta, cu, None)
    _, state_fp32_gate = adapter.recurrent_kernel(q, k, v, gate.astype(np.float32), beta, cu, None)
    np.testing.assert_allclose(state, state_bf16_gate, rtol=1e-6, atol=1e-7)
    assert np.abs(state - state_fp32_gate).max() > 1e-4


@needs_checkout
def test_its_decode_gate_has_no_lower_bound() -> None:
    """sglang-jax's `_fused_kda_gate` is the softplus gate: a lower bound is a path it lacks (the check
    skips with this reason), raised before anything runs."""
    adapter = _adapter("fp32")
    heads, dim = adapter.config.num_heads, adapter.config.head_dim
    x = np.zeros((4, heads, dim), np.float32)
    with pytest.raises(NotImplementedError, match=r"_fused_kda_gate\) is the softplus gate only"):
        adapter.recurrent_kernel_raw_gate(
            x, x, x, x, np.zeros((4, heads), np.float32), np.zeros(heads, np.float32),
            np.zeros(heads * dim, np.float32), -3.0, np.array([0, 4]), None,
        )  # fmt: skip
