"""Seeded defects of the second KDA family (docs/search.md, "Seeded defects"): each the built-in
`KDAImplAdapter` with one bug that a Kimi-Linear set cannot show, because it is in what the families do
differently. Each passes golden/ and fails a lower-bound (GLM-5.3-Flash) set; `diff` names the gate `g`
as the first stage that departs, and the search finds each unaided.

- `SoftplusGateEverywhere`: the layer computes Kimi-Linear's softplus gate whatever the family;
- `LowerBoundFixedAtMinusFive`: the lower-bound gate with L = -5 (transformers', fla's and Kimi-K3's
  default) instead of the config's `gate_lower_bound`: right on every set made at -5 only;
- `ALogUnderKimiName`: the weights read by Kimi-Linear's names and layout: GLM's `forget_gate.A_log`
  `[H]` is not where Kimi's `A_log` `[1, 1, H, 1]` is, so the layer keeps its initialiser's value, which
  for a lower-bound layer is zeros (every head's rate 1).
"""

from __future__ import annotations

from typing import Any

import jax

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from kda_impl.kernels.common import kda_gate
from kda_impl.models.kimi_linear import KimiDeltaAttention

# The lower bound a `LowerBoundFixedAtMinusFive` layer holds fixed.
FIXED_LOWER_BOUND = -5.0


class _SoftplusGateLayer(KimiDeltaAttention):
    def _decay(self, x: jax.Array) -> jax.Array:
        heads, dim = self.attn.num_heads, self.config.head_dim
        f = self._rounded(self.f_b_proj(self._rounded(self.f_a_proj(x)))).astype(jax.numpy.float32)
        return kda_gate(f.reshape(-1, heads, dim), self.A_log[...][:, None], self.dt_bias[...])


class _FixedLowerBoundLayer(KimiDeltaAttention):
    def _decay(self, x: jax.Array) -> jax.Array:
        if self.config.gate_lower_bound is None:
            return super()._decay(x)
        heads, dim = self.attn.num_heads, self.config.head_dim
        f = self._rounded(self.f_b_proj(self._rounded(self.f_a_proj(x)))).astype(jax.numpy.float32)
        a_log, dt_bias = self.A_log[...][:, None], self.dt_bias[...]
        return kda_gate(f.reshape(-1, heads, dim), a_log, dt_bias, FIXED_LOWER_BOUND)


class SoftplusGateEverywhere(KDAImplAdapter):
    name = "softplus-gate-everywhere"
    layer_class = _SoftplusGateLayer


class LowerBoundFixedAtMinusFive(KDAImplAdapter):
    name = "lower-bound-fixed-at-minus-five"
    layer_class = _FixedLowerBoundLayer


class ALogUnderKimiName(KDAImplAdapter):
    name = "a-log-under-kimi-name"

    def __init__(self, config: Any, weights: dict, *args: Any, **kwargs: Any):
        if "forget_gate.A_log" in weights:  # not Kimi's "A_log": the initialiser's zeros stay
            weights = {**weights, "forget_gate.A_log": 0.0 * weights["forget_gate.A_log"]}
        super().__init__(config, weights, *args, **kwargs)


FAMILY_DEFECTS = (SoftplusGateEverywhere, LowerBoundFixedAtMinusFive, ALogUnderKimiName)
