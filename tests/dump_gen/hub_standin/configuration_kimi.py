"""Stand-in for the hub's `configuration_kimi.py`: a transformers config with the fields the KDA layer,
its cache and the model classes of `modeling_kimi.py` read. Written for the tests, not copied."""

from __future__ import annotations

from typing import Any

from transformers.configuration_utils import PretrainedConfig


class KimiLinearConfig(PretrainedConfig):
    model_type = "kimi_linear"

    def __init__(
        self,
        hidden_size: int = 2304,
        num_hidden_layers: int = 27,
        rms_norm_eps: float = 1e-5,
        kv_lora_rank: int | None = 512,
        linear_attn_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.rms_norm_eps = rms_norm_eps
        self.kv_lora_rank = kv_lora_rank
        self.linear_attn_config = linear_attn_config
        super().__init__(**kwargs)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def is_kda_layer(self, layer_idx: int) -> bool:
        """`kda_layers` counts layers from 1."""
        linear = self.linear_attn_config
        return linear is not None and (layer_idx + 1) in linear["kda_layers"]
