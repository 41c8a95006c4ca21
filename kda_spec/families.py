"""The KDA families: the forms of the layer the ecosystem ships, each defined once.

Pure Python (no JAX, no torch). A family says the layer's forget-gate form, its conv layout, its
weights' checkpoint names and shapes, and which weights a bf16 run keeps in fp32:

- `kimi-linear` (Kimi-Linear-48B-A3B; transformers' `KimiLinearDeltaAttention`, the hub file): the
  gate `g = -exp(A_log) * softplus(f + dt_bias)`, three depthwise convs `{q,k,v}_conv1d.weight`
  `[P, 1, W]`, `A_log` `[1, 1, H, 1]`, the decay weights under the layer itself.
- `glm5-next` (GLM-5.3-Flash, transformers' `Glm5NextTextLinearAttention`; Kimi-K3's gate): the
  lower-bound ("safe") gate `g = L * sigmoid(exp(A_log) * (f + dt_bias))`, `L = gate_lower_bound < 0`,
  one fused depthwise `conv1d.weight` `[3P, 1, W]` over q | k | v, `A_log` `[H]`, the gate's weights
  under `forget_gate.`; the conv weight is kept in fp32 in a bf16 run (transformers'
  `_keep_in_fp32_modules_strict`), as `A_log` and `dt_bias` are.

Everything that computes the layer reads the weights in one form, the *canonical* one: Kimi-Linear's
names and shapes. `canonical_weights` maps a family's checkpoint-named weights to it (exactly: a
split of the fused conv, a reshape of `A_log`, renames), `family_weights` back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kda_spec.config import KDAConfig

SOFTPLUS_GATE = "softplus"
LOWER_BOUND_GATE = "lower-bound"
SEPARATE_CONVS = "separate"
FUSED_CONV = "fused"

# The canonical (Kimi-Linear) names of the weights that differ between the families.
CANONICAL_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
# The projections every family has under the same name.
SHARED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")


@dataclasses.dataclass(frozen=True)
class KDAFamily:
    """One form of the KDA layer.

    `gate`: SOFTPLUS_GATE or LOWER_BOUND_GATE. `conv`: SEPARATE_CONVS or FUSED_CONV. `gate_prefix`: the
    prefix of the decay gate's weights (`f_a_proj`, `f_b_proj`, `A_log`, `dt_bias`) in a checkpoint.
    `a_log_per_head`: `A_log` stored `[H]` (else `[1, 1, H, 1]`). `fp32_canonical`: the canonical names
    of the weights a bf16 run keeps in fp32. `reference`: the transformers class that is this family's
    reference."""

    name: str
    gate: str
    conv: str
    gate_prefix: str
    a_log_per_head: bool
    fp32_canonical: frozenset[str]
    reference: str
    description: str

    @property
    def lower_bound_gate(self) -> bool:
        return self.gate == LOWER_BOUND_GATE

    def renames(self) -> dict[str, str]:
        """Canonical name → this family's checkpoint name, for every weight but the convs."""
        gate = {
            name: self.gate_prefix + name
            for name in ("f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias")
        }
        shared = {f"{name}.weight": f"{name}.weight" for name in SHARED_PROJECTIONS}
        return {**shared, **gate, "o_norm.weight": "o_norm.weight"}

    def checkpoint_name(self, canonical: str) -> str:
        """The checkpoint name of canonical weight `canonical` (a canonical conv of a fused family:
        `conv1d.weight`, which holds it)."""
        if canonical in CANONICAL_CONVS:
            return "conv1d.weight" if self.conv == FUSED_CONV else canonical
        return self.renames()[canonical]

    @property
    def decay_parameters(self) -> tuple[str, str]:
        """The checkpoint names of `A_log` and `dt_bias`, the decay gate's parameters."""
        return self.checkpoint_name("A_log"), self.checkpoint_name("dt_bias")

    @property
    def fp32_weights(self) -> frozenset[str]:
        """The checkpoint names of the weights a bf16 run keeps in fp32."""
        return frozenset(self.checkpoint_name(name) for name in self.fp32_canonical)

    def weight_shapes(self, config: KDAConfig) -> dict[str, tuple[int, ...]]:
        """Every checkpoint name of one layer of this family and its shape (torch layout)."""
        canonical = canonical_weight_shapes(config)
        shapes = {family: canonical[name] for name, family in self.renames().items()}
        if self.a_log_per_head:
            shapes[self.gate_prefix + "A_log"] = (config.num_heads,)
        if self.conv == FUSED_CONV:
            shapes["conv1d.weight"] = (config.conv_dim, 1, config.conv_size)
        else:
            shapes.update({name: canonical[name] for name in CANONICAL_CONVS})
        return shapes


KIMI_LINEAR = KDAFamily(
    name="kimi-linear",
    gate=SOFTPLUS_GATE,
    conv=SEPARATE_CONVS,
    gate_prefix="",
    a_log_per_head=False,
    fp32_canonical=frozenset({"A_log", "dt_bias"}),
    reference="transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
    description="Kimi-Linear: softplus gate, three convs, A_log [1, 1, H, 1]",
)
GLM5_NEXT = KDAFamily(
    name="glm5-next",
    gate=LOWER_BOUND_GATE,
    conv=FUSED_CONV,
    gate_prefix="forget_gate.",
    a_log_per_head=True,
    fp32_canonical=frozenset({"A_log", "dt_bias", *CANONICAL_CONVS}),
    reference="transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextLinearAttention",
    description="GLM-5.3-Flash / Kimi-K3: lower-bound gate L, one fused conv, A_log [H]",
)
FAMILIES: dict[str, KDAFamily] = {family.name: family for family in (KIMI_LINEAR, GLM5_NEXT)}


def get_family(name: str) -> KDAFamily:
    """The named family, or a ValueError listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown KDA family {name!r}; known families: {sorted(FAMILIES)}") from None


def canonical_weight_shapes(config: KDAConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical (Kimi-Linear) weight name of one layer and its shape (torch layout)."""
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


def canonical_weights(config: KDAConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`config.family`'s checkpoint-named `weights` (no layer prefix) in the canonical form, exactly
    (renames, the fused conv split into q | k | v, `A_log` reshaped); a KeyError names a missing weight."""
    family = config.kda_family
    missing = [name for name in family.weight_shapes(config) if name not in weights]
    if missing:
        raise KeyError(f"{family.name} weights lack {missing}; present: {sorted(weights)}")
    canonical = {name: np.asarray(weights[checkpoint]) for name, checkpoint in family.renames().items()}
    canonical["A_log"] = canonical["A_log"].reshape(1, 1, config.num_heads, 1)
    if family.conv == FUSED_CONV:
        canonical.update(zip(CANONICAL_CONVS, np.split(np.asarray(weights["conv1d.weight"]), 3, axis=0)))
    else:
        canonical.update({name: np.asarray(weights[name]) for name in CANONICAL_CONVS})
    return canonical


def family_weights(config: KDAConfig, canonical: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of `canonical_weights`: canonical `canonical` under `config.family`'s checkpoint names."""
    family = config.kda_family
    weights = {checkpoint: np.asarray(canonical[name]) for name, checkpoint in family.renames().items()}
    if family.a_log_per_head:
        weights[family.gate_prefix + "A_log"] = weights[family.gate_prefix + "A_log"].reshape(
            config.num_heads
        )
    if family.conv == FUSED_CONV:
        weights["conv1d.weight"] = np.concatenate([np.asarray(canonical[name]) for name in CANONICAL_CONVS])
    else:
        weights.update({name: np.asarray(canonical[name]) for name in CANONICAL_CONVS})
    return weights
