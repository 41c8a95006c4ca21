"""Seeded defects of kda_impl's layer backward, for the layer gradient checks (`layer-grad-*`,
`layer-grad-causal`).

- `ALogGradientScaled`: the gradient of `A_log` 1% off (a decay parameter's gradient mis-scaled, as a
  hand-written backward that forgets a factor of the gate's form would have it).
- `LookAheadLayer`: a layer whose every token reads the next one's hidden state (a short conv padded on
  the wrong side): its gradients are the right ones of a non-causal layer, so the values differ from the
  truth and the gradients before a position P move when the inputs from P on change.
"""

from __future__ import annotations

import numpy as np

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from kda_spec.layer_vjp import HIDDEN_STATES_GRADIENT
from kda_spec.weight_names import hf_weight_shapes

LOOK_AHEAD = np.float32(0.01)


class ALogGradientScaled(KDAImplAdapter):
    name = "alog-gradient-scaled"

    def layer_vjp(self, hidden_states, cu_seqlens, initial_state, dout, dht):
        grads = super().layer_vjp(hidden_states, cu_seqlens, initial_state, dout, dht)
        (a_log,) = (name for name in hf_weight_shapes(self.config) if name.endswith("A_log"))
        return {**grads, a_log: grads[a_log] * np.float32(1.01)}


class LookAheadLayer(KDAImplAdapter):
    name = "look-ahead-layer"

    def layer_vjp(self, hidden_states, cu_seqlens, initial_state, dout, dht):
        ahead = np.zeros_like(hidden_states)
        ahead[:-1] = hidden_states[1:]
        grads = super().layer_vjp(hidden_states + LOOK_AHEAD * ahead, cu_seqlens, initial_state, dout, dht)
        dx = grads[HIDDEN_STATES_GRADIENT]  # of the mixed input: x_t enters rows t and t - 1
        behind = np.zeros_like(dx)
        behind[1:] = dx[:-1]
        return {**grads, HIDDEN_STATES_GRADIENT: dx + LOOK_AHEAD * behind}
