"""Stand-in for the hub's `configuration_kimi.py`: the fields the KDA layer and its cache read."""

from __future__ import annotations

from typing import Any


class KimiLinearConfig:
    def __init__(
        self,
        hidden_size: int = 2304,
        num_hidden_layers: int = 27,
        rms_norm_eps: float = 1e-5,
        linear_attn_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.rms_norm_eps = rms_norm_eps
        self.linear_attn_config = linear_attn_config
        for name, value in kwargs.items():
            setattr(self, name, value)

    def is_kda_layer(self, layer_idx: int) -> bool:
        linear = self.linear_attn_config
        return linear is not None and (layer_idx + 1) in linear["kda_layers"]
