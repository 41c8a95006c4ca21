"""The float64 truth of the layer's backward: the vector-Jacobian product of `kda_spec.truth`'s layer.

numpy only, by hand, stage by stage in reverse (no autodiff framework, nothing shared with a kernel under
test): `o_proj`, the gated RMSNorm, the delta rule (`kda_spec.truth.packed_delta_rule_vjp`), the l2
norms, the short convs and their silu, the gate of the layer's family, beta's sigmoid, and every
projection. The forward is `kda_spec.truth`'s own functions; each stage's adjoint is written beside the
forward it differentiates (`layer_vjp`'s docstring has them). `tests/conformance/test_layer_vjp.py` holds
it against central differences of `kda_spec.truth.layer_truth` in float64, weight by weight.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.families import canonical_weights, family_weights
from kda_spec.truth import (
    L2NORM_EPS,
    SOFTPLUS_THRESHOLD,
    causal_conv,
    forget_gate,
    packed_delta_rule,
    packed_delta_rule_vjp,
    sigmoid,
)

# The gradients `layer_vjp` returns beside the weights', by name: of the hidden states and the initial
# recurrent states.
HIDDEN_STATES_GRADIENT = "hidden_states"
INITIAL_STATE_GRADIENT = "initial_state"


def layer_vjp(
    weights: Mapping[str, np.ndarray],
    hidden_states: np.ndarray,  # [T, hidden]
    cu_seqlens: np.ndarray,  # [N+1]
    initial_state: np.ndarray | None,  # [N, H, D, D] or None (zeros)
    config: KDAConfig,
    dout: np.ndarray,  # [T, hidden] the output's cotangent
    dht: np.ndarray,  # [N, H, D, D] the final states' cotangent
    dtype: type[np.floating] = np.float64,
    squares: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The gradients of `sum(out * dout) + sum(final_state * dht)` for `kda_spec.truth.layer_truth` on one
    packed batch, every step in `dtype`: `hidden_states` [T, hidden], `initial_state` [N, H, D, D] (of
    the initial states, zeros in their place when there are none), and every weight under `config`'s
    family's checkpoint name and shape (`weights`' names).

    Forward (per head where per head; s = sigmoid, P = H·D):
        u = x Wᵀ (q, k, v)   c = conv(u)   a = silu(c)   q̂ = a_q / sqrt(|a_q|² + 1e-6)   (k̂ alike)
        f = (x W_faᵀ) W_fbᵀ + dt_bias   g = gate(f, A_log)   β = s(x W_bᵀ)   z = (x W_gaᵀ) W_gbᵀ
        o, S = delta rule(q̂, k̂, a_v, g, β; S0)   r = (mean(o²) + eps)^-1/2   n = r o
        y = n · w · s(z)   out = y W_oᵀ
    Adjoints, from dout and dS = dht:
        dy = dout W_o          dW_o = doutᵀ y         dw = Σ dy·n·s(z)       dz = dy·n·w·s(z)(1 - s(z))
        dn = dy·w·s(z)         do = r (dn - n mean(dn·n))
        dq̂, dk̂, da_v, dg, dβ, dS0 = the delta rule's vjp (`packed_delta_rule_vjp`)
        da_q = (dq̂ - q̂ (dq̂·q̂)) / sqrt(|a_q|² + 1e-6)            dc = da · s(c)(1 + c(1 - s(c)))
        du[t] = Σ_j taps_j dc[t + W-1-j]   dtaps_j = Σ_t dc[t] u[t-(W-1)+j]   (within each sequence)
        softplus gate g = -e^A sp(f): df = -e^A s(f) dg (1 above the threshold 20), dA = Σ dg·g
        lower-bound gate g = L s(e^A f): df = dg L s'(e^A f) e^A, dA = Σ dg L s'(e^A f) e^A f
        dℓ = dβ β(1 - β) for β's logit ℓ; and for every projection y = a Wᵀ: dW = dyᵀ a, da = dy W.

    `squares`, when given, receives for every weight (canonical names) the sum of the squares of the terms
    its gradient sums (`(dy²)ᵀ a²` for a projection): the scale of its rounding (`kda_spec.truth.
    summation_scale`; a gradient whose terms cancel is far smaller than its terms).
    """
    heads, dim = config.num_heads, config.head_dim
    w = {name: np.asarray(array, dtype) for name, array in canonical_weights(config, weights).items()}
    x = np.asarray(hidden_states, dtype)
    tokens = x.shape[0]
    spans = list(itertools.pairwise(np.asarray(cu_seqlens).tolist()))
    init = None if initial_state is None else np.asarray(initial_state, dtype)

    def per_head(a: np.ndarray) -> np.ndarray:
        return a.reshape(tokens, heads, -1)

    def flat(a: np.ndarray) -> np.ndarray:
        return a.reshape(tokens, -1)

    grads: dict[str, np.ndarray] = {}
    dx = np.zeros_like(x)

    def project_back(a: np.ndarray, name: str, dy: np.ndarray) -> np.ndarray:
        """Adds the gradient of `name`'s weight for `y = a Wᵀ`; returns the gradient of `a`."""
        weight = w[f"{name}.weight"]
        grads[f"{name}.weight"] = dy.T @ a
        if squares is not None:
            squares[f"{name}.weight"] = (dy * dy).T @ (a * a)
        return dy @ weight

    # forward, keeping what the adjoints read
    convs = {}
    for n in "qkv":
        u = x @ w[f"{n}_proj.weight"].T
        c = causal_conv(u, w[f"{n}_conv1d.weight"], spans)
        convs[n] = (u, c, c * sigmoid(c))
    norms = {
        n: np.sqrt(np.sum(per_head(convs[n][2]) ** 2, axis=-1, keepdims=True) + L2NORM_EPS) for n in "qk"
    }
    q, k = (per_head(convs[n][2]) / norms[n] for n in "qk")
    v = per_head(convs["v"][2])
    fa = x @ w["f_a_proj.weight"].T
    f = per_head(fa @ w["f_b_proj.weight"].T) + w["dt_bias"].reshape(heads, dim)
    a_log = w["A_log"].reshape(heads, 1)
    g = forget_gate(f, w["A_log"], config)
    beta = sigmoid(x @ w["b_proj.weight"].T)
    ga = x @ w["g_a_proj.weight"].T
    z = per_head(ga @ w["g_b_proj.weight"].T)
    o, _ = packed_delta_rule(q, k, v, g, beta, cu_seqlens, init)
    r = 1 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + config.rms_norm_eps)
    n_o = o * r
    gate = sigmoid(z)
    norm_weight = w["o_norm.weight"]

    # output projection and gated RMSNorm
    dy = per_head(project_back(flat(n_o * norm_weight * gate), "o_proj", np.asarray(dout, dtype)))
    grads["o_norm.weight"] = np.sum(dy * n_o * gate, axis=(0, 1))
    if squares is not None:
        squares["o_norm.weight"] = np.sum((dy * n_o * gate) ** 2, axis=(0, 1))
    dz = dy * n_o * norm_weight * gate * (1 - gate)
    dn = dy * norm_weight * gate
    do = r * (dn - n_o * np.mean(dn * n_o, axis=-1, keepdims=True))
    dga = project_back(ga, "g_b_proj", flat(dz))
    dx += project_back(x, "g_a_proj", dga)

    # the recurrence
    rec = packed_delta_rule_vjp(q, k, v, g, beta, cu_seqlens, init, do, np.asarray(dht, dtype))
    initial_gradient = rec["dh0"]

    # beta
    dx += project_back(x, "b_proj", rec["dbeta"] * beta * (1 - beta))

    # the gate
    rate = np.exp(a_log)
    if config.kda_family.lower_bound_gate:
        s = sigmoid(rate * f)
        slope = np.asarray(config.gate_lower_bound, dtype) * s * (1 - s) * rate  # dg/df
        df = rec["dg"] * slope
        a_log_terms = df * f
    else:
        df = rec["dg"] * -rate * np.where(f > SOFTPLUS_THRESHOLD, 1, sigmoid(f))
        a_log_terms = rec["dg"] * g
    grads["A_log"] = np.sum(a_log_terms, axis=(0, 2)).reshape(w["A_log"].shape)
    grads["dt_bias"] = np.sum(df, axis=0).reshape(w["dt_bias"].shape)
    if squares is not None:
        squares["A_log"] = np.sum(a_log_terms**2, axis=(0, 2)).reshape(w["A_log"].shape)
        squares["dt_bias"] = np.sum(df * df, axis=0).reshape(w["dt_bias"].shape)
    dfa = project_back(fa, "f_b_proj", flat(df))
    dx += project_back(x, "f_a_proj", dfa)

    # l2 norms, silu, short convs, projections
    activation_grads = {
        "q": (rec["dq"] - q * np.sum(rec["dq"] * q, axis=-1, keepdims=True)) / norms["q"],
        "k": (rec["dk"] - k * np.sum(rec["dk"] * k, axis=-1, keepdims=True)) / norms["k"],
        "v": rec["dv"],
    }
    for n in "qkv":
        u, c, _ = convs[n]
        s = sigmoid(c)
        dc = flat(activation_grads[n]) * s * (1 + c * (1 - s))
        du, grads[f"{n}_conv1d.weight"] = causal_conv_vjp(u, w[f"{n}_conv1d.weight"], spans, dc)
        if squares is not None:
            weight = w[f"{n}_conv1d.weight"]
            _, squares[f"{n}_conv1d.weight"] = causal_conv_vjp(u * u, weight, spans, dc * dc)
        dx += project_back(x, f"{n}_proj", du)
    return {
        **family_weights(config, grads),
        HIDDEN_STATES_GRADIENT: dx,
        INITIAL_STATE_GRADIENT: initial_gradient,
    }


def causal_conv_vjp(
    u: np.ndarray,  # [T, C] the conv's input
    weight: np.ndarray,  # [C, 1, W]
    spans: list[tuple[int, int]],
    dc: np.ndarray,  # [T, C] the cotangent of `kda_spec.truth.causal_conv(u, weight, spans)`
) -> tuple[np.ndarray, np.ndarray]:
    """The gradients (of u [T, C], of weight [C, 1, W]) of `sum(causal_conv(u, weight, spans) * dc)`:
    `du[t] = sum_j taps_j dc[t + W-1-j]`, `dtaps_j = sum_t dc[t] u[t-(W-1)+j]`, within each sequence."""
    width = weight.shape[-1]
    taps = weight[:, 0, :]
    du = np.zeros_like(u)
    dtaps = np.zeros_like(taps)
    for start, end in spans:
        length = end - start
        padded_u = np.concatenate([np.zeros((width - 1, u.shape[1]), u.dtype), u[start:end]])
        padded_dc = np.concatenate([dc[start:end], np.zeros((width - 1, u.shape[1]), u.dtype)])
        for j in range(width):
            du[start:end] += taps[:, j] * padded_dc[width - 1 - j : width - 1 - j + length]
            dtaps[:, j] += np.sum(dc[start:end] * padded_u[j : j + length], axis=0)
    return du, dtaps[:, None, :]
