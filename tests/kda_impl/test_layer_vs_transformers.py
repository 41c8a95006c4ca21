"""KimiDeltaAttention through the serving path against transformers' `KimiLinearDeltaAttention`.

fp32 must agree at atol = rtol = 1e-5 (RFC §2.3). bf16 is judged against the float64 truth of the bf16
run beside the same transformers layer run in bf16 (the two round at different points), and held to the
bf16 element-wise gate 1e-2 + 1e-2|b| against it; the RFC's element-wise 1e-3 verdict is printed, never
asserted.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conformance.judging.attribution import error_vs_truth, relative_criteria
from conformance.judging.verdict import unmet
from conformance.policy import TolerancePolicy
from kda_impl.kernels.common import softplus
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.truth import layer_truth, run_weights
from tests.kda_impl.conftest import CONFIGS, assert_close, random_states, random_tokens

SINGLE_LENGTHS = (1, 65, 200)
PACKED_LENGTHS = (5, 65, 1, 120, 17)
POLICY = TolerancePolicy.load()


@pytest.mark.torch
@pytest.mark.parametrize("config_name", ["mini", "d128"])
def test_fp32_single_sequences(config_name, runner_for, torch_reference):
    runner, reference = runner_for(config_name), torch_reference(config_name)
    rng = np.random.default_rng(1)
    for length in SINGLE_LENGTHS:
        x = random_tokens(rng, runner.config, length)
        slots = runner.alloc(1)
        out = runner.extend([x], slots).outs[0]
        expected_out, expected_state = reference.prefill(x)
        assert_close(out, expected_out)
        assert_close(runner.states(slots)[0][0], expected_state)
        runner.free(slots)


@pytest.mark.torch
@pytest.mark.parametrize("config_name", ["mini", "d128"])
def test_fp32_packed_batch_with_initial_states(config_name, runner_for, torch_reference):
    runner, reference = runner_for(config_name), torch_reference(config_name)
    rng = np.random.default_rng(2)
    xs = [random_tokens(rng, runner.config, length) for length in PACKED_LENGTHS]
    initial = random_states(rng, runner.config, len(xs))
    initial[2] = 0.0  # one fresh sequence among continued ones
    slots = runner.alloc(len(xs))
    runner.write_recurrent(slots, initial)
    outs = runner.extend(xs, slots).outs
    expected_outs, expected_states = reference.prefill_packed(xs, initial)
    for out, expected in zip(outs, expected_outs):
        assert_close(out, expected)
    assert_close(runner.states(slots)[0], expected_states)


def _nrmse(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def _bf16_verdicts(actual: np.ndarray, expected: np.ndarray) -> dict[str, float]:
    diff = np.abs(actual.astype(np.float64) - expected)
    rfc_ratio = diff / (1e-3 + 1e-3 * np.abs(expected))
    return {
        "gate_worst_ratio": float(np.max(diff / (1e-2 + 1e-2 * np.abs(expected)))),
        "normalised_rmse": _nrmse(actual, expected),
        "rfc_1e-3_share_outside": float(np.mean(rfc_ratio > 1)),
        "rfc_1e-3_worst_ratio": float(np.max(rfc_ratio)),
    }


@pytest.mark.torch
def test_bf16_is_no_further_from_the_float64_truth_than_transformers_bf16(runner_for, torch_reference):
    """The two bf16 layers round at different points (docs/bf16-rounding.md: kda_impl follows the hub's
    fla kernels, e.g. one rounding after the short conv's silu), so each is judged against the float64
    truth of the bf16 run: kda_impl's normalised RMSE is no larger than transformers', for the output
    and the final states, and it passes the suite's relative bf16 gate (conformance/tolerances.toml)
    against transformers. The element-wise and RFC 1e-3 verdicts against transformers are printed."""
    runner, reference = runner_for("mini", "bf16"), torch_reference("mini", "bf16")
    rng = np.random.default_rng(3)
    # The inputs are bf16-representable so both sides start from the same values.
    xs = [random_tokens(rng, runner.config, n).astype(jnp.bfloat16).astype(np.float32) for n in (65, 120, 1)]
    initial = random_states(rng, runner.config, len(xs))
    slots = runner.alloc(len(xs))
    runner.write_recurrent(slots, initial)
    out = np.concatenate(runner.extend(xs, slots).outs)
    expected_outs, expected_states = reference.prefill_packed(xs, initial)
    cu_seqlens = np.cumsum([0, *(len(x) for x in xs)])
    weights = run_weights(synthetic_weights(runner.config, seed=0), "bf16", runner.config)
    truth = layer_truth(weights, np.concatenate(xs), cu_seqlens, initial, runner.config)

    for name, actual, wanted, true in (
        ("out", out, np.concatenate(expected_outs), truth["out"]),
        ("final_state", runner.states(slots)[0], expected_states, truth["recurrent_state"]),
    ):
        verdicts = _bf16_verdicts(actual, wanted)
        impl_error, reference_error = _nrmse(actual, true), _nrmse(wanted, true)
        print(
            f"bf16 {name}: vs truth kda_impl {impl_error:.3g}, transformers {reference_error:.3g}; "
            + ", ".join(f"{key}={value:.3g}" for key, value in verdicts.items())
        )
        assert np.all(np.isfinite(actual))
        assert impl_error <= reference_error, (name, impl_error, reference_error)
        tolerance = POLICY.tolerance("layer", "bf16")
        impl_side, reference_side = (
            error_vs_truth(actual, true, tolerance),
            error_vs_truth(wanted, true, tolerance),
        )
        assert unmet(relative_criteria(impl_side, reference_side, POLICY.relative["bf16"])) == [], (
            impl_side,
            reference_side,
        )


def test_softplus_is_exact_above_the_threshold():
    z = jnp.asarray([-30.0, 0.0, 19.0, 20.5, 25.0, 100.0], jnp.float32)
    expected = np.log1p(np.exp(np.asarray(z, np.float64)))
    expected[3:] = np.asarray(z)[3:]  # identity above 20, where a clipped log1p would give 20
    np.testing.assert_allclose(np.asarray(softplus(z)), expected, rtol=1e-6, atol=1e-12)


def test_gate_beta_and_output_gate_intermediates_follow_the_spec(runner_for):
    """g, beta and g_out against the spec's formulas in float64 numpy, from the HF weights."""
    runner = runner_for("mini")
    config, weights = CONFIGS["mini"], synthetic_weights(CONFIGS["mini"], seed=0)
    x = random_tokens(np.random.default_rng(4), config, 65)
    slots = runner.alloc(1)
    intermediates = runner.extend([x], slots).intermediates
    heads, dim = config.num_heads, config.head_dim

    x64 = x.astype(np.float64)
    f = x64 @ weights["f_a_proj.weight"].T @ weights["f_b_proj.weight"].T + weights["dt_bias"]
    g = -np.exp(weights["A_log"].reshape(heads, 1)) * np.log1p(np.exp(f.reshape(-1, heads, dim)))
    beta = 1.0 / (1.0 + np.exp(-(x64 @ weights["b_proj.weight"].T)))
    g_out = (x64 @ weights["g_a_proj.weight"].T @ weights["g_b_proj.weight"].T).reshape(-1, heads, dim)
    assert_close(intermediates["g"], g)
    assert_close(intermediates["beta"], beta)
    assert_close(intermediates["g_out"], g_out)
    width = config.conv_size
    for name in ("q", "k", "v"):
        u = np.concatenate([np.zeros((width - 1, heads * dim)), x64 @ weights[f"{name}_proj.weight"].T])
        taps = weights[f"{name}_conv1d.weight"][:, 0, :]  # [P, W]
        y = sum(taps[:, j] * u[j : j + len(x)] for j in range(width))
        assert_close(intermediates[f"{name}_after_conv"], (y / (1.0 + np.exp(-y))).reshape(-1, heads, dim))
    assert intermediates["o_norm"].shape == (65, heads, dim)
