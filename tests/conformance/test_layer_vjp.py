"""The float64 truth of the layer's backward (kda_spec.layer_vjp) is the derivative of the layer's float64
truth (kda_spec.truth.layer_truth): central differences in float64, input by input and weight by weight,
for both families."""

from __future__ import annotations

import numpy as np
import pytest

from kda_spec.config import get_preset
from kda_spec.layer_vjp import HIDDEN_STATES_GRADIENT, INITIAL_STATE_GRADIENT, layer_vjp
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.truth import layer_truth

CU_SEQLENS = np.array([0, 5, 6, 13], np.int32)  # a sequence over the conv's width, one of one token, one more
PRESETS = ("mini", "glm5-next-mini")


def _tiny(preset: str):
    return get_preset(preset).replace(hidden_size=12, num_heads=2, head_dim=4, preset="custom")


def _loss(weights, x, init, config, dout, dht) -> float:
    result = layer_truth(weights, x, CU_SEQLENS, init, config)
    return float(np.sum(result["out"] * dout) + np.sum(result["recurrent_state"] * dht))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_gradient_is_the_central_difference_of_the_layer_truth(preset: str) -> None:
    """For each input and weight X, a random direction V: `sum(dX * V)` against `(L(X + hV) - L(X - hV))
    / 2h` of the float64 layer, L = sum(out * dout) + sum(final states * dht). The difference quotient's
    own error is O(h²) plus rounding, at most 1e-7 relative here; a wrong adjoint is off by O(1)."""
    config = _tiny(preset)
    rng = np.random.default_rng(7)
    weights = {name: np.asarray(a, np.float64) for name, a in synthetic_weights(config, seed=3).items()}
    tokens, num_seqs = int(CU_SEQLENS[-1]), len(CU_SEQLENS) - 1
    heads, dim = config.num_heads, config.head_dim
    x = rng.standard_normal((tokens, config.hidden_size))
    init = 0.3 * rng.standard_normal((num_seqs, heads, dim, dim))
    dout = rng.standard_normal((tokens, config.hidden_size))
    dht = rng.standard_normal((num_seqs, heads, dim, dim))
    grads = layer_vjp(weights, x, CU_SEQLENS, init, config, dout, dht)
    assert set(grads) == {*weights, HIDDEN_STATES_GRADIENT, INITIAL_STATE_GRADIENT}

    def loss_with(name: str, value: np.ndarray) -> float:
        if name == HIDDEN_STATES_GRADIENT:
            return _loss(weights, value, init, config, dout, dht)
        if name == INITIAL_STATE_GRADIENT:
            return _loss(weights, x, value, config, dout, dht)
        return _loss({**weights, name: value}, x, init, config, dout, dht)

    points = {**weights, HIDDEN_STATES_GRADIENT: x, INITIAL_STATE_GRADIENT: init}
    errors = {}
    for name, point in points.items():
        assert grads[name].shape == point.shape, name
        direction = rng.standard_normal(point.shape)
        step = 1e-6 * max(1.0, float(np.max(np.abs(point))))
        quotient = (loss_with(name, point + step * direction) - loss_with(name, point - step * direction)) / (
            2 * step
        )
        exact = float(np.sum(grads[name] * direction))
        errors[name] = abs(exact - quotient) / max(abs(quotient), 1e-12)
    assert max(errors.values()) < 1e-6, errors


def test_without_initial_states_the_gradient_of_the_zero_states_is_returned() -> None:
    config = _tiny("mini")
    rng = np.random.default_rng(1)
    weights = synthetic_weights(config, seed=1)
    tokens, num_seqs = int(CU_SEQLENS[-1]), len(CU_SEQLENS) - 1
    x = rng.standard_normal((tokens, config.hidden_size))
    dout = rng.standard_normal((tokens, config.hidden_size))
    dht = rng.standard_normal((num_seqs, config.num_heads, config.head_dim, config.head_dim))
    zeros = np.zeros_like(dht)
    without = layer_vjp(weights, x, CU_SEQLENS, None, config, dout, dht)
    with_zeros = layer_vjp(weights, x, CU_SEQLENS, zeros, config, dout, dht)
    for name, value in without.items():
        np.testing.assert_array_equal(value, with_zeros[name], err_msg=name)
