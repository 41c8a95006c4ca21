"""The sglang-jax adapter's layout conversions, against a numpy stand-in of sglang-jax's conventions.

sglang-jax itself is not needed: the stand-in below computes what its `LinearBase` (x @ W, W [in, out]),
its depthwise `short_convolution` (weight [P, W], cache [N, P, W-1] of the last W-1 inputs) and its
states ([N, H, K, V]) compute, from the converted weights; the reference side uses the HF layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from examples.sglang_jax.adapter import SglangJaxAdapter, import_sgl_jax
from examples.sglang_jax.layout import (
    check_state,
    conv_state_to_dump,
    seq_lens_of,
    sglang_jax_params,
)
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.weight_names import PROJECTIONS

CONFIG = get_preset("mini").replace(hidden_size=32, head_dim=8)


def standin_linear(x: np.ndarray, weight_in_out: np.ndarray) -> np.ndarray:
    """sglang-jax's LinearBase: x @ weight, weight [in, out]."""
    return x @ weight_in_out


def standin_short_conv(x: np.ndarray, weight_p_w: np.ndarray, cache_p_w1: np.ndarray) -> tuple:
    """sglang-jax's short conv of one sequence: weight [P, W], cache [P, W-1] (oldest first); no
    activation. Returns (y [T, P], new cache [P, W-1])."""
    window = np.concatenate([cache_p_w1.T, x])  # [W-1+T, P], time first
    width = weight_p_w.shape[1]
    y = np.stack([np.sum(window[t : t + width].T * weight_p_w, axis=1) for t in range(x.shape[0])])
    return y, window[-(width - 1) :].T


def hf_conv(x: np.ndarray, weight_p_1_w: np.ndarray) -> np.ndarray:
    """torch's causal depthwise Conv1d of the HF layer ([P, 1, W], left zero padding), by definition."""
    width = weight_p_1_w.shape[-1]
    padded = np.concatenate([np.zeros((width - 1, x.shape[1]), x.dtype), x])
    return np.stack(
        [sum(padded[t + j] * weight_p_1_w[:, 0, j] for j in range(width)) for t in range(x.shape[0])]
    )


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return synthetic_weights(CONFIG, seed=5)


def test_projections_compute_what_the_hf_layer_does(weights: dict[str, np.ndarray]) -> None:
    params = sglang_jax_params(CONFIG, weights)
    rng = np.random.default_rng(0)
    for name in PROJECTIONS:
        hf = weights[f"{name}.weight"]  # [out, in]
        x = rng.standard_normal((5, hf.shape[1])).astype(np.float32)
        np.testing.assert_allclose(
            standin_linear(x, params[f"{name}.weight"]), x @ hf.T, rtol=1e-5, atol=1e-6
        )
    for name in ("A_log", "dt_bias", "o_norm.weight"):
        np.testing.assert_array_equal(params[name], weights[name])


def test_conv_weights_and_states_convert_both_ways(weights: dict[str, np.ndarray]) -> None:
    params = sglang_jax_params(CONFIG, weights)
    width, proj = CONFIG.conv_size, CONFIG.proj_dim
    x = np.random.default_rng(1).standard_normal((7, proj)).astype(np.float32)
    for name in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
        assert params[name].shape == (proj, width)
        y, cache = standin_short_conv(x, params[name], np.zeros((proj, width - 1), np.float32))
        np.testing.assert_allclose(y, hf_conv(x, weights[name]), rtol=1e-5, atol=1e-6)
    # The dump's final_conv_state holds each sequence's last W-1 inputs, time first: [N, W-1, 3P].
    packed = np.concatenate([cache, 2 * cache, 3 * cache])[None]  # q, k, v channels: [1, 3P, W-1]
    dumped = conv_state_to_dump(packed)
    assert dumped.shape == (1, width - 1, 3 * proj)
    np.testing.assert_array_equal(dumped[0, :, :proj], x[-(width - 1) :])
    np.testing.assert_array_equal(dumped[0, :, 2 * proj :], 3 * x[-(width - 1) :])


def test_states_keep_their_key_value_axes_and_bad_shapes_are_named() -> None:
    heads, dim = CONFIG.num_heads, CONFIG.head_dim
    state = np.random.default_rng(2).standard_normal((3, heads, dim, dim)).astype(np.float32)
    # The harness's S[k, v] is sglang-jax's [N, H, K, V]: o = q @ S reads keys on axis 2.
    assert check_state(state, CONFIG, 3) is not None
    np.testing.assert_array_equal(check_state(state, CONFIG, 3), state)
    with pytest.raises(
        ValueError, match=r"initial_state must be \[N, H, K, V\]=\(2, 2, 8, 8\).*got \(3, 2, 8, 8\)"
    ):
        check_state(state, CONFIG, 2)
    with pytest.raises(ValueError, match="conv state must be"):
        conv_state_to_dump(np.zeros((3, 4)))


def test_cu_seqlens_become_checked_int32_lengths() -> None:
    lens = seq_lens_of(np.array([0, 70, 73]), 73)
    assert lens.dtype == np.int32 and lens.tolist() == [70, 3]
    for bad, message in (
        (np.array([0, 70, 72]), "must rise from 0 to 73"),
        (np.array([0, 0, 73]), "must rise from 0 to 73"),
        (np.array([0.0, 73.0]), "1-D int array"),
    ):
        with pytest.raises(ValueError, match=message):
            seq_lens_of(bad, 73)


def test_bad_weights_and_missing_checkout_are_named(
    weights: dict[str, np.ndarray], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"weights: missing 'o_proj.weight' \(expected shape \(32, 16\)\)"):
        sglang_jax_params(CONFIG, {k: v for k, v in weights.items() if k != "o_proj.weight"})
    bad = dict(weights, A_log=np.zeros((2,), np.float32))
    with pytest.raises(ValueError, match=r"weights: 'A_log' has shape \(2,\), expected \(1, 1, 2, 1\)"):
        sglang_jax_params(CONFIG, bad)
    monkeypatch.delenv("SGLANG_JAX", raising=False)
    with pytest.raises(ValueError, match="give the sglang-jax checkout"):
        SglangJaxAdapter.parse_options({})
    with pytest.raises(ValueError, match="interpret='yes': expected 1 or 0"):
        SglangJaxAdapter.parse_options({"sglang_jax": str(tmp_path), "interpret": "yes"})
    with pytest.raises(ValueError, match="track_interval='0': expected a whole number > 0"):
        SglangJaxAdapter.parse_options({"sglang_jax": str(tmp_path), "track_interval": "0"})
    assert (
        SglangJaxAdapter.parse_options({"sglang_jax": str(tmp_path), "track_interval": "64"})[
            "track_interval"
        ]
        == 64
    )
    with pytest.raises(ValueError, match="no sgl_jax/srt/kernels/kda under"):
        import_sgl_jax(str(tmp_path))
