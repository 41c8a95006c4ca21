"""Names and shapes of one KDA layer's weights: HF checkpoint names and transformers' state_dict names.

numpy only (no torch, no JAX), so the dump generator can import it. HF names are given without the
`model.layers.{i}.self_attn.` prefix; every `*.weight` of a Linear is torch layout (`y = x @ W.T`).
transformers' `KimiLinearDeltaAttention` concatenates the three depthwise convs into one
`conv1d.weight` `[3P, 1, W]` (q | k | v) and keeps the decay gate under `forget_gate.*`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kda_impl.config import KDAConfig

LAYER_PREFIX = "model.layers.{layer}.self_attn."
CONV_NAMES = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
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
FP32_WEIGHTS = frozenset({"A_log", "dt_bias"})  # kept fp32 in a bf16 run


def layer_prefix(layer_idx: int) -> str:
    """`model.layers.{layer_idx}.self_attn.`, the checkpoint prefix of one layer's attention weights."""
    return LAYER_PREFIX.format(layer=layer_idx)


def hf_weight_shapes(config: KDAConfig) -> dict[str, tuple[int, ...]]:
    """Every HF weight name of one KDA layer and its shape (torch layout)."""
    hidden, heads, dim, width, proj = (
        config.hidden_size,
        config.num_heads,
        config.head_dim,
        config.conv_size,
        config.proj_dim,
    )
    return {
        "q_proj.weight": (proj, hidden),
        "k_proj.weight": (proj, hidden),
        "v_proj.weight": (proj, hidden),
        "q_conv1d.weight": (proj, 1, width),
        "k_conv1d.weight": (proj, 1, width),
        "v_conv1d.weight": (proj, 1, width),
        "f_a_proj.weight": (dim, hidden),
        "f_b_proj.weight": (proj, dim),
        "A_log": (1, 1, heads, 1),
        "dt_bias": (proj,),
        "b_proj.weight": (heads, hidden),
        "g_a_proj.weight": (dim, hidden),
        "g_b_proj.weight": (proj, dim),
        "o_norm.weight": (dim,),
        "o_proj.weight": (hidden, proj),
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
