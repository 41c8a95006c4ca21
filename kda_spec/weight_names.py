"""Names and shapes of one KDA layer's weights, as the HF checkpoint names them (the contract).

Pure Python. HF names are given without the `model.layers.{i}.self_attn.` prefix; every `*.weight` of a
Linear is torch layout (`y = x @ W.T`). The torch references check their own modules' parameters
against this table (dump_gen.references.layout), so a wrong entry here fails a test.
"""

from __future__ import annotations

from kda_spec.config import KDAConfig

LAYER_PREFIX = "model.layers.{layer}.self_attn."
# The layer's Linear projections, each `<name>.weight` (torch layout).
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "f_b_proj",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "o_proj",
)
CONV_NAMES = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
FP32_WEIGHTS = frozenset({"A_log", "dt_bias"})  # kept fp32 in a bf16 run


def layer_prefix(layer_idx: int) -> str:
    """`model.layers.{layer_idx}.self_attn.`, the checkpoint prefix of one layer's attention weights."""
    return LAYER_PREFIX.format(layer=layer_idx)


def hf_weight_shapes(config: KDAConfig) -> dict[str, tuple[int, ...]]:
    """Every HF weight name of one KDA layer and its shape (torch layout)."""
    hidden, heads, dim, proj = config.hidden_size, config.num_heads, config.head_dim, config.proj_dim
    width = config.conv_size
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
