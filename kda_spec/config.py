"""Shape and numeric configuration of one KDA layer, and the named presets.

Pure Python (no JAX import) so that the torch dump generator can share the presets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kda_spec.families import GLM5_NEXT, KIMI_LINEAR, KDAFamily, get_family


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Configuration of one KDA layer.

    `hidden_size` is the model width; the q/k/v/g width is `P = num_heads * head_dim`. `family` names
    the layer's form (`kda_spec.families`); `gate_lower_bound` is the lower-bound gate's L (< 0), set
    exactly when the family's gate is the lower-bound one.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_size: int = 4
    rms_norm_eps: float = 1e-5
    preset: str = "custom"
    # 1-based indices of the KDA layers in the full model (the other layers are MLA).
    kda_layers: tuple[int, ...] = ()
    num_hidden_layers: int = 1
    family: str = KIMI_LINEAR.name
    gate_lower_bound: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "conv_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KDAConfig.{name} must be a positive integer, got {value!r}")
        if self.conv_size < 2:
            raise ValueError(
                f"KDAConfig.conv_size must be >= 2 (a state of conv_size-1 inputs), got {self.conv_size}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"KDAConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        family = get_family(self.family)
        bound = self.gate_lower_bound
        if family.lower_bound_gate:
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -1e4 <= bound < 0:
                raise ValueError(
                    f"KDAConfig.gate_lower_bound must be a number in [-1e4, 0) for the {family.name} "
                    f"family's lower-bound gate, got {bound!r}"
                )
        elif bound is not None:
            raise ValueError(
                f"KDAConfig.gate_lower_bound={bound!r} is set, but the {family.name} family's gate is "
                f"{family.gate}, which has no lower bound"
            )

    @property
    def kda_family(self) -> KDAFamily:
        """The layer's family (`kda_spec.families`)."""
        return get_family(self.family)

    @property
    def proj_dim(self) -> int:
        """P = num_heads * head_dim, the width of q, k, v, g and the output gate."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the q|k|v short convolution (3P)."""
        return 3 * self.proj_dim

    def is_kda_layer(self, layer_idx: int) -> bool:
        """Whether 0-based `layer_idx` is a KDA layer (`kda_layers` is 1-based, as in config.json)."""
        return (layer_idx + 1) in self.kda_layers

    def to_manifest(self) -> dict[str, Any]:
        """The `config` block of a dump manifest."""
        return {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "conv_size": self.conv_size,
            "rms_norm_eps": self.rms_norm_eps,
            "preset": self.preset,
            "family": self.family,
            "gate_lower_bound": self.gate_lower_bound,
        }

    @classmethod
    def from_manifest(cls, block: dict[str, Any]) -> KDAConfig:
        """Inverse of `to_manifest`; unknown keys are ignored, missing ones named. A block without
        `family` (a dump written before families) is Kimi-Linear's."""
        required = ("hidden_size", "num_heads", "head_dim", "conv_size", "rms_norm_eps")
        missing = [key for key in required if key not in block]
        if missing:
            raise ValueError(f"manifest config block lacks {missing}; found keys {sorted(block)}")
        return cls(
            hidden_size=int(block["hidden_size"]),
            num_heads=int(block["num_heads"]),
            head_dim=int(block["head_dim"]),
            conv_size=int(block["conv_size"]),
            rms_norm_eps=float(block["rms_norm_eps"]),
            preset=str(block.get("preset", "custom")),
            family=str(block.get("family", KIMI_LINEAR.name)),
            gate_lower_bound=_optional_float(block.get("gate_lower_bound")),
        )

    def replace(self, **changes: Any) -> KDAConfig:
        return dataclasses.replace(self, **changes)


# Kimi-Linear-48B-A3B config.json: hidden_size 2304, linear_attn_config {num_heads 32, head_dim 128,
# short_conv_kernel_size 4, kda_layers}, rms_norm_eps 1e-5, 27 layers of which 7 are MLA.
_KIMI_KDA_LAYERS = (1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26)

_GLM_KDA_LAYERS = tuple(index + 1 for index in range(45) if index % 4 != 3)

PRESETS: dict[str, KDAConfig] = {
    "kimi-linear-48b-a3b": KDAConfig(
        hidden_size=2304,
        num_heads=32,
        head_dim=128,
        conv_size=4,
        rms_norm_eps=1e-5,
        preset="kimi-linear-48b-a3b",
        kda_layers=_KIMI_KDA_LAYERS,
        num_hidden_layers=27,
    ),
    # Small enough for the committed golden set and CPU tests; keeps D a multiple of 32 and H > 1.
    "mini": KDAConfig(
        hidden_size=128,
        num_heads=2,
        head_dim=64,
        conv_size=4,
        rms_norm_eps=1e-5,
        preset="mini",
        kda_layers=(1,),
        num_hidden_layers=1,
    ),
    # transformers 5.24.0 `Glm5NextTextConfig` defaults: hidden_size 4096, linear_num_heads 64,
    # linear_head_dim 128, linear_conv_kernel_dim 4, linear_lower_bound -5.0, rms_norm_eps 1e-5,
    # 45 layers of which those with 0-based index % 4 != 3 are KDA.
    "glm-5.3-flash": KDAConfig(
        hidden_size=4096,
        num_heads=64,
        head_dim=128,
        conv_size=4,
        rms_norm_eps=1e-5,
        preset="glm-5.3-flash",
        kda_layers=_GLM_KDA_LAYERS,
        num_hidden_layers=45,
        family=GLM5_NEXT.name,
        gate_lower_bound=-5.0,
    ),
    # mini's shape with the GLM layer's structure (fused conv, lower-bound gate).
    "glm5-next-mini": KDAConfig(
        hidden_size=128,
        num_heads=2,
        head_dim=64,
        conv_size=4,
        rms_norm_eps=1e-5,
        preset="glm5-next-mini",
        kda_layers=(1,),
        num_hidden_layers=1,
        family=GLM5_NEXT.name,
        gate_lower_bound=-5.0,
    ),
}


def _optional_float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"manifest config gate_lower_bound must be a number or null, got {value!r}")
    return float(value)


def get_preset(name: str) -> KDAConfig:
    """The named preset, or a ValueError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}") from None
