"""The layer's float32 master weights under their HF names, seeded and synthetic.

HF names are the checkpoint names of one KDA layer of the config's family without the
`model.layers.{i}.self_attn.` prefix (`kda_spec.dump_format.weight_shapes`). The weights are drawn in
the canonical form (`kda_spec.families`, Kimi-Linear's names, which the hub's `KimiDeltaAttention`
uses) and returned under the family's names.
"""

from __future__ import annotations

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.families import CANONICAL_CONVS, canonical_weight_shapes, family_weights

# Stream 0 of the run's seed draws the weights; the cases use their own streams (inputs.py).
WEIGHTS_STREAM = 0
STRESS_STREAM = 1 << 16  # the stress weights' extra draws: clear of the cases' streams (1 + i)


def synthetic_weights(config: KDAConfig, seed: int) -> dict[str, np.ndarray]:
    """One KDA layer's weights under its family's names, float32, drawn from `seed` (`_canonical`)."""
    return family_weights(config, _canonical(config, seed))


def _canonical(config: KDAConfig, seed: int) -> dict[str, np.ndarray]:
    """One KDA layer's canonical weights, float32, drawn from `seed` with the scales of a trained layer.

    - projections: N(0, 1/fan_in), so every projection of a unit-scale input is unit-scale (at the real
      width 2304 this is HF's `initializer_range` 0.02);
    - depthwise convs: U(±1/sqrt(W)), torch's default for a conv of fan-in W;
    - `A_log = log U(1, 16)` and `dt_bias = softplus⁻¹(dt)` with `log dt ~ U(log 1e-3, log 1e-1)`,
      fla's and HF's initialisers: per-step decays from about 0.999 to 0.2. A lower-bound family's
      initialiser sets `A_log = 0`, which makes every head's rate 1 and hides a head or layout mix-up,
      so its `A_log = log U(1/2, 2)` (the same draw, rescaled): rates within 2x of the initialiser's,
      distinct per head; with its `dt_bias` (the same initialiser) g = L * sigmoid(rate * f) is about
      L/100 to L/3 per token;
    - `o_norm.weight ~ U(0.5, 1.5)`, not ones, so that a misplaced norm weight shows.
    """
    rng = np.random.default_rng([seed, WEIGHTS_STREAM])
    weights = {}
    for name, shape in canonical_weight_shapes(config).items():
        if name == "A_log":
            rate = rng.uniform(1.0, 16.0, shape)
            values = (
                np.log(0.5 + 1.5 * (rate - 1.0) / 15.0)
                if config.kda_family.lower_bound_gate
                else np.log(rate)
            )
        elif name == "dt_bias":
            dt = np.maximum(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape)), 1e-4)
            values = dt + np.log(-np.expm1(-dt))
        elif name == "o_norm.weight":
            values = rng.uniform(0.5, 1.5, shape)
        elif name in CANONICAL_CONVS:
            bound = config.conv_size**-0.5
            values = rng.uniform(-bound, bound, shape)
        else:
            values = rng.normal(0.0, shape[1] ** -0.5, shape)
        weights[name] = values.astype(np.float32)
    return weights


# `--weights stress`: the strongest decays a trained layer can reach, for the numerics of the kernels.
STRESS_MAX_DECAY_RATE = 16.0  # exp(A_log) of the strongest head
STRESS_DT_BIAS = (0.0, 1.0)  # dt_bias of the stressed channels: softplus(dt_bias) from 0.7 to 1.3
# A lower-bound family's stressed channels: rate * (f + dt_bias) about 2 to 60, sigmoid 0.9 to 1, g at L.
STRESS_FLOOR_DT_BIAS = (2.0, 4.0)
STRESS_CHANNEL_SHARE = 4  # every 4th channel of each head is stressed


def stress_weights(config: KDAConfig, seed: int) -> dict[str, np.ndarray]:
    """`synthetic_weights` with decays far stronger than an initialised layer's, the same otherwise.

    - `exp(A_log)` spread evenly over [1, 16] across the heads, so the last head has exactly 16;
    - every 4th channel of each head gets `dt_bias ~ U(0, 1)` (an initialised layer's is about -7 to
      -2): with unit-scale gate pre-activations f, per-token `g = -exp(A_log) * softplus(f + dt_bias)`
      reaches about -60 (down to about -80) on those channels of the strongest head, and a 64-token
      chunk's running sum of g goes to -1000 and below, where kernels that subtract such sums in
      fp32 lose their digits;
    - a lower-bound family's stressed channels get `dt_bias ~ U(2, 4)` instead, which holds
      `g = L * sigmoid(exp(A_log) * (f + dt_bias))` at its floor, 0.9 L to L, so a 64-token chunk's
      running sum reaches about 64 L (-320 at L = -5): the regime of sgl-jax PR #1587, where a bounded
      gate at a packed-sequence boundary overflowed `exp2` before the mask.
    """
    weights = _canonical(config, seed)
    rates = np.linspace(1.0, STRESS_MAX_DECAY_RATE, config.num_heads) if config.num_heads > 1 else [16.0]
    weights["A_log"] = (
        np.log(np.asarray(rates, np.float64)).reshape(weights["A_log"].shape).astype(np.float32)
    )
    rng = np.random.default_rng([seed, STRESS_STREAM])
    dt_bias = weights["dt_bias"].reshape(config.num_heads, config.head_dim).copy()
    stressed = dt_bias[:, ::STRESS_CHANNEL_SHARE]
    low, high = STRESS_FLOOR_DT_BIAS if config.kda_family.lower_bound_gate else STRESS_DT_BIAS
    dt_bias[:, ::STRESS_CHANNEL_SHARE] = rng.uniform(low, high, stressed.shape)
    weights["dt_bias"] = dt_bias.reshape(-1).astype(np.float32)
    return family_weights(config, weights)


WEIGHTS_KINDS = {"synthetic": synthetic_weights, "stress": stress_weights}
