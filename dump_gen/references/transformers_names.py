"""HF checkpoint names ↔ the state_dict names of transformers' `KimiLinearDeltaAttention`.

transformers' port concatenates the three depthwise convs into one `conv1d.weight` `[3P, 1, W]`
(q | k | v) and keeps the decay gate under `forget_gate.*`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kda_spec.families import CANONICAL_CONVS as CONV_NAMES

TRANSFORMERS_CONV_NAME = "conv1d.weight"
# HF name -> transformers state_dict name, for every weight but the three convs.
HF_TO_TRANSFORMERS = {
    "q_proj.weight": "q_proj.weight",
    "k_proj.weight": "k_proj.weight",
    "v_proj.weight": "v_proj.weight",
    "f_a_proj.weight": "forget_gate.f_a_proj.weight",
    "f_b_proj.weight": "forget_gate.f_b_proj.weight",
    "A_log": "forget_gate.A_log",
    "dt_bias": "forget_gate.dt_bias",
    "b_proj.weight": "b_proj.weight",
    "g_a_proj.weight": "g_a_proj.weight",
    "g_b_proj.weight": "g_b_proj.weight",
    "o_norm.weight": "o_norm.weight",
    "o_proj.weight": "o_proj.weight",
}


def hf_to_transformers(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named weights (no prefix) → a `KimiLinearDeltaAttention` state_dict (numpy arrays)."""
    _require(weights, [*HF_TO_TRANSFORMERS, *CONV_NAMES], "HF weights")
    state = {HF_TO_TRANSFORMERS[name]: np.asarray(weights[name]) for name in HF_TO_TRANSFORMERS}
    state[TRANSFORMERS_CONV_NAME] = np.concatenate([np.asarray(weights[name]) for name in CONV_NAMES], axis=0)
    return state


def transformers_to_hf(state_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A `KimiLinearDeltaAttention` state_dict (numpy arrays) → HF-named weights (no prefix)."""
    to_hf = {tf_name: hf_name for hf_name, tf_name in HF_TO_TRANSFORMERS.items()}
    _require(state_dict, [*to_hf, TRANSFORMERS_CONV_NAME], "transformers state_dict")
    weights = {hf_name: np.asarray(state_dict[tf_name]) for tf_name, hf_name in to_hf.items()}
    conv = np.asarray(state_dict[TRANSFORMERS_CONV_NAME])
    if conv.shape[0] % 3:
        raise ValueError(
            f"{TRANSFORMERS_CONV_NAME} must stack q | k | v convs ([3P, 1, W]), got {conv.shape}"
        )
    weights.update(zip(CONV_NAMES, np.split(conv, 3, axis=0)))
    return weights


def _require(mapping: Mapping[str, object], names: list[str], what: str) -> None:
    missing = [name for name in names if name not in mapping]
    if missing:
        raise KeyError(f"{what} lack {missing}; present: {sorted(mapping)}")
