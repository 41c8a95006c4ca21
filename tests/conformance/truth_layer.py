"""The float64 truth of the synthetic sets: the dumps' own oracle (`kda_spec.truth.layer_truth`) on the
inputs each run saw.

The fp32 run's truth comes from its float32 inputs and weights; the bf16 run's from the hidden states
and weights rounded to bf16 first (`A_log` and `dt_bias` stay fp32, as the bf16 run keeps them); then
everything in float64.
"""

from __future__ import annotations

import numpy as np

from kda_spec import truth
from kda_spec.config import KDAConfig
from kda_spec.weight_names import fp32_weights
from tests.conformance.numpy_adapter import round_bf16


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
    kept = fp32_weights(config)
    w = {name: round_bf16(a) if rounded and name not in kept else a for name, a in weights.items()}
    x = round_bf16(hidden_states) if rounded else hidden_states
    return truth.layer_truth(w, x, cu_seqlens, initial_state, config, np.float64)
