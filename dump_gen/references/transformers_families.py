"""Where each KDA family's layer lives in transformers, and how its weights and config are named there.

- `kimi-linear`: `KimiLinearDeltaAttention` (`models/kimi_linear`), its state_dict named apart from the
  checkpoint (`transformers_names`: one concatenated conv, the gate under `forget_gate.`);
- `glm5-next`: `Glm5NextTextLinearAttention` (`models/glm5_next`), whose state_dict names and shapes are
  the family's own (`kda_spec.families`: `conv1d.weight` `[3P, 1, W]`, `forget_gate.*`, `A_log` `[H]`).

Both modules call the module-level kernel functions `chunk_kimi_delta_attention` and
`recurrent_kimi_delta_attention` with the same arguments, and hold the forget gate as a submodule
`forget_gate` (Kimi's: `KimiLinearForgetGate`, GLM's: `Glm5NextTextForgetGate`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dump_gen.references.transformers_names import HF_TO_TRANSFORMERS, hf_to_transformers, transformers_to_hf
from kda_spec.config import KDAConfig
from kda_spec.families import GLM5_NEXT, KIMI_LINEAR, KDAFamily

Renaming = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def _same_names(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(array) for name, array in weights.items()}


@dataclasses.dataclass(frozen=True)
class TransformersLayer:
    """One family's KDA module in transformers (the family's `reference`, `kda_spec.families`): how a
    one-layer config of a KDAConfig's shape is made, and the renaming between the family's checkpoint
    names and the module's state_dict."""

    family: KDAFamily
    make_config: Callable[[KDAConfig], Any]
    to_module: Renaming  # the family's checkpoint-named weights -> the module's state_dict
    from_module: Renaming  # inverse of `to_module`
    module_names: Callable[[frozenset[str]], frozenset[str]]  # checkpoint names -> state_dict names

    def module_name(self, name: str) -> str:
        """The module's state_dict name of checkpoint name `name`."""
        (module,) = self.module_names(frozenset({name}))
        return module

    @property
    def layer_class(self) -> str:
        return self.family.reference.rpartition(".")[2]

    def modeling(self) -> Any:
        """The modeling module that defines the layer class and the kernel functions it calls."""
        return importlib.import_module(self.family.reference.rpartition(".")[0])


def _kimi_config(config: KDAConfig) -> Any:
    """A one-layer `KimiLinearConfig` whose only layer is a KDA layer of `config`'s shape."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    return KimiLinearConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=1,
        rms_norm_eps=config.rms_norm_eps,
        linear_attn_config={
            "head_dim": config.head_dim,
            "num_heads": config.num_heads,
            "short_conv_kernel_size": config.conv_size,
            "kda_layers": [1],
            "full_attn_layers": [],
        },
    )


def _glm_config(config: KDAConfig) -> Any:
    """A one-layer `Glm5NextTextConfig` whose only layer is a KDA (`linear_attention`) layer of `config`'s
    shape and gate lower bound."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=1,
        rms_norm_eps=config.rms_norm_eps,
        linear_num_heads=config.num_heads,
        linear_head_dim=config.head_dim,
        linear_conv_kernel_dim=config.conv_size,
        linear_lower_bound=config.gate_lower_bound,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
    )


TRANSFORMERS_LAYERS: dict[str, TransformersLayer] = {
    KIMI_LINEAR.name: TransformersLayer(
        family=KIMI_LINEAR,
        make_config=_kimi_config,
        to_module=hf_to_transformers,
        from_module=transformers_to_hf,
        module_names=lambda names: frozenset(HF_TO_TRANSFORMERS[name] for name in names),
    ),
    GLM5_NEXT.name: TransformersLayer(
        family=GLM5_NEXT,
        make_config=_glm_config,
        to_module=_same_names,
        from_module=_same_names,
        module_names=lambda names: names,
    ),
}


def transformers_layer(config: KDAConfig) -> TransformersLayer:
    """The transformers module of `config`'s family; a ValueError for a family transformers lacks."""
    try:
        return TRANSFORMERS_LAYERS[config.family]
    except KeyError:
        raise ValueError(
            f"no transformers reference for the {config.family} family; known: {sorted(TRANSFORMERS_LAYERS)}"
        ) from None
