"""The run's matmul precision: JAX's `jax_default_matmul_precision`, and what DEFAULT means where it ran.

An fp32 `dot` at DEFAULT precision is one bf16 pass on a TPU (bf16 operands, fp32 accumulation) and TF32
on an sm80+ GPU (A100, H100: operands rounded to a 10-bit mantissa); on a CPU it is fp32. Only
`Precision.HIGHEST` (or `jax.default_matmul_precision("highest")`, which sets the default for dots that
name none) is fp32 everywhere. The report keeps both as `environment.platform.matmul_precision` and
says them on its first screen, so that an fp32 run far off on a TPU or GPU points at the likely cause.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SETTING = "jax_default_matmul_precision"
_MEANINGS = {
    "tpu": "one bf16 pass per matmul (bf16 operands, fp32 accumulation)",
    "cpu": "fp32",
}
_TF32 = "TF32 (operands rounded to a 10-bit mantissa, fp32 accumulation)"
_FIRST_TF32_MAJOR = 8  # sm80 (A100) and later


def default_meaning(platform: str, compute_capability: str | None = None) -> str:
    """What an fp32 dot at DEFAULT precision computes on `platform` (`cuda`: by its compute capability,
    "9.0" for an H100)."""
    if platform == "cuda":
        if compute_capability is None:
            return f"{_TF32} on sm80+ (A100, H100), fp32 before"
        major = int(compute_capability.split(".")[0])
        return _TF32 if major >= _FIRST_TF32_MAJOR else "fp32"
    return _MEANINGS.get(platform, f"not known to this suite on {platform}")


def matmul_precision(platform: str, compute_capability: str | None = None) -> dict[str, Any]:
    """report.json's `environment.platform.matmul_precision`: the run's setting (None: unset, dots that
    name no precision run at DEFAULT) and what DEFAULT means on `platform`."""
    import jax

    value = getattr(jax.config, SETTING)
    return {
        SETTING: None if value is None else str(value),
        "default_means": default_meaning(platform, compute_capability),
    }


def matmul_precision_line(block: Mapping[str, Any]) -> str:
    """`matmul precision: jax_default_matmul_precision unset; DEFAULT on tpu: one bf16 pass per matmul …`."""
    value = block.get(SETTING)
    setting = f"{SETTING} unset" if value is None else f"{SETTING}={value!r}"
    return f"matmul precision: {setting}; an fp32 dot at DEFAULT here is {block.get('default_means', '?')}"
