"""Names and shapes of one KDA layer's weights, as the HF checkpoint names them (the contract).

Pure Python. HF names are given without the `model.layers.{i}.self_attn.` prefix; every `*.weight` of a
Linear is torch layout (`y = x @ W.T`). The names and shapes are the layer's family's
(`kda_spec.families`); the torch references check their own modules' parameters against this table
(dump_gen.references.layout), so a wrong entry here fails a test.
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


def layer_prefix(layer_idx: int) -> str:
    """`model.layers.{layer_idx}.self_attn.`, the checkpoint prefix of one layer's attention weights."""
    return LAYER_PREFIX.format(layer=layer_idx)


def hf_weight_shapes(config: KDAConfig) -> dict[str, tuple[int, ...]]:
    """Every HF weight name of one KDA layer of `config`'s family and its shape (torch layout)."""
    return config.kda_family.weight_shapes(config)


def fp32_weights(config: KDAConfig) -> frozenset[str]:
    """The HF names of the weights a bf16 run of `config`'s family keeps in fp32."""
    return config.kda_family.fp32_weights
