"""Every KDA family through the serving path against the float64 truth (`kda_spec.truth`), which was
itself checked against transformers' `Glm5NextTextLinearAttention` (tests/dump_gen).

fp32 must agree at atol = rtol = 1e-5 (RFC §2.3): a prefill, a packed batch with initial states, decode
steps continuing it, and the gate at its floor (the stress weights). The layer's structure follows the
family: one fused conv parameter, the lower-bound gate.
"""

from __future__ import annotations

import numpy as np
import pytest

from kda_impl.weights import layer_from_hf_weights
from kda_spec.config import KDAConfig
from kda_spec.synthetic_weights import stress_weights, synthetic_weights
from kda_spec.truth import layer_truth
from tests.kda_impl.conftest import CONFIGS, LayerRunner, assert_close, random_states, random_tokens

GLM_CONFIGS = ("glm5-next-mini", "glm-d128")


def _truth(config: KDAConfig, weights: dict, xs: list[np.ndarray], initial: np.ndarray | None) -> dict:
    cu_seqlens = np.cumsum([0, *(len(x) for x in xs)])
    return layer_truth(weights, np.concatenate(xs), cu_seqlens, initial, config)


@pytest.mark.parametrize("config_name", GLM_CONFIGS)
def test_lower_bound_family_prefill_and_decode_match_the_truth(config_name, runner_for):
    runner, config = runner_for(config_name), CONFIGS[config_name]
    weights = synthetic_weights(config, seed=0)
    rng = np.random.default_rng(5)
    xs = [random_tokens(rng, config, n) for n in (65, 1, 130)]
    initial = random_states(rng, config, len(xs))
    slots = runner.alloc(len(xs))
    runner.write_recurrent(slots, initial)
    step = runner.extend(xs, slots)
    truth = _truth(config, weights, xs, initial)
    assert_close(np.concatenate(step.outs), truth["out"])
    assert_close(runner.states(slots)[0], truth["recurrent_state"])
    assert_close(step.intermediates["g"], truth["g"])
    assert truth["g"].min() >= config.gate_lower_bound

    tokens = random_tokens(rng, config, len(xs))
    decoded = runner.decode(tokens, slots)
    whole = _truth(config, weights, [np.concatenate([x, t[None]]) for x, t in zip(xs, tokens)], initial)
    last = np.cumsum([len(x) + 1 for x in xs]) - 1
    assert_close(decoded, whole["out"][last])
    assert_close(runner.states(slots)[0], whole["recurrent_state"])


def test_the_gate_at_its_floor_matches_the_truth():
    """Stress weights hold g at L in every 4th channel: a 130-token prefill still agrees in fp32."""
    config = CONFIGS["glm5-next-mini"]
    weights = stress_weights(config, seed=0)
    runner = LayerRunner(config, weights, np.float32)
    xs = [random_tokens(np.random.default_rng(6), config, 130)]
    slots = runner.alloc(1)
    step = runner.extend(xs, slots)
    truth = _truth(config, weights, xs, None)
    floor_share = np.mean(truth["g"] < 0.9 * config.gate_lower_bound)
    assert floor_share > 0.2, floor_share
    assert_close(np.concatenate(step.outs), truth["out"])
    assert_close(runner.states(slots)[0], truth["recurrent_state"])


def test_a_fused_family_layer_has_one_conv_parameter_holding_q_k_v():
    config = CONFIGS["glm5-next-mini"]
    weights = synthetic_weights(config, seed=0)
    module = layer_from_hf_weights(config, 0, weights, np.float32)
    assert not hasattr(module, "q_conv1d")
    taps = np.asarray(module.conv1d[...])  # [W, 3, P]
    fused = weights["conv1d.weight"][:, 0, :]  # [3P, W]
    np.testing.assert_array_equal(taps.reshape(config.conv_size, -1).T, fused)


def test_a_kimi_checkpoint_name_is_refused_for_a_glm_layer():
    config = CONFIGS["glm5-next-mini"]
    weights = synthetic_weights(config, seed=0)
    weights["A_log"] = weights.pop("forget_gate.A_log").reshape(1, 1, -1, 1)
    with pytest.raises(ValueError, match=r"unknown weight.*'A_log'"):
        layer_from_hf_weights(config, 0, weights, np.float32)
