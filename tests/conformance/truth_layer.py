"""The layer in float64 numpy (kda-layer.md, no rounding anywhere): the truth of the synthetic sets.

The truth of a run follows the truth contract of issue 10: the fp32 run's from its float32 inputs and
weights; the bf16 run's from the hidden states and weights rounded to bf16 first (`A_log` and
`dt_bias` stay fp32, as the bf16 run keeps them); then everything in float64.
"""

from __future__ import annotations

import itertools

import numpy as np

from conformance.truth import recurrence_fp64
from kda_spec.config import KDAConfig
from tests.conformance.numpy_adapter import round_bf16

_KEPT_FP32_IN_BF16 = ("A_log", "dt_bias")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def layer_truth(
    config: KDAConfig,
    weights: dict[str, np.ndarray],
    dtype: str,
    hidden_states: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """The float64 output, final recurrent states and intermediates of the `dtype` run, by truth name."""
    rounded = dtype == "bf16"
    w = {
        name: np.asarray(round_bf16(a) if rounded and name not in _KEPT_FP32_IN_BF16 else a, np.float64)
        for name, a in weights.items()
    }
    x = np.asarray(round_bf16(hidden_states) if rounded else hidden_states, np.float64)
    tokens, heads, dim = x.shape[0], config.num_heads, config.head_dim

    def linear(h: np.ndarray, name: str) -> np.ndarray:
        return h @ w[f"{name}.weight"].T

    def per_head(h: np.ndarray) -> np.ndarray:
        return h.reshape(tokens, heads, dim)

    u = np.concatenate([linear(x, f"{p}_proj") for p in "qkv"], axis=1)
    kernel = np.concatenate([w[f"{p}_conv1d.weight"][:, 0, :] for p in "qkv"], axis=0)  # [3P, W]
    width = kernel.shape[1]
    conv = np.zeros_like(u)
    for lo, hi in itertools.pairwise(cu_seqlens):
        padded = np.concatenate([np.zeros((width - 1, u.shape[1])), u[lo:hi]])
        conv[lo:hi] = np.stack([np.sum(padded[t : t + width] * kernel.T, axis=0) for t in range(hi - lo)])
    conv = conv * _sigmoid(conv)
    q, k, v = (per_head(part) for part in np.split(conv, 3, axis=1))
    f = per_head(linear(linear(x, "f_a_proj"), "f_b_proj")) + w["dt_bias"].reshape(1, heads, dim)
    g = -np.exp(w["A_log"]).reshape(1, heads, 1) * np.where(f > 20, f, np.log1p(np.exp(np.minimum(f, 20))))
    beta = _sigmoid(linear(x, "b_proj"))

    def l2norm(a: np.ndarray) -> np.ndarray:
        return a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)

    o, states = recurrence_fp64(l2norm(q), l2norm(k), v, g, beta, cu_seqlens, initial_state)
    g_out = per_head(linear(linear(x, "g_a_proj"), "g_b_proj"))
    rms = 1 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + config.rms_norm_eps)
    o_norm = o * rms * w["o_norm.weight"] * _sigmoid(g_out)
    out = linear(o_norm.reshape(tokens, -1), "o_proj")
    return {
        "out": out,
        "recurrent_state": states,
        "q_after_conv": q,
        "k_after_conv": k,
        "v_after_conv": v,
        "g": g,
        "beta": beta,
        "g_out": g_out,
        "o_norm": o_norm,
    }
