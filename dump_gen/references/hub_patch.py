"""The one fix the hub's `modeling_kimi.py` needs (RFC §6.1.5): its gate call on fla's current gate.

The hub file was written against fla 0.4.0, whose gate was
`fused_kda_gate(g, A, head_k_dim, g_bias=None, beta=1.0, threshold=20.0)` with `g` as `[..., H*D]`. From
fla 0.4.1 on it is `fused_kda_gate(g, A_log, dt_bias=None, lower_bound=None, output_dtype=fp32)` with `g`
as `[..., H, D]`, and the hub call fails. The patched layer subclasses the hub's `KimiDeltaAttention`
and overrides `forward`: the hub's own forward runs unchanged, with its module's `fused_kda_gate` bound
for the call to an adapter that reshapes `g` and calls the current signature with `dt_bias` (same math).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dump_gen.capture import replaced

GATE_NAME = "fused_kda_gate"
PATCH_NOTE = (
    "KimiDeltaAttention.forward: fused_kda_gate(g, A_log, head_dim, g_bias=dt_bias) (fla 0.4.0 signature) "
    "called as fused_kda_gate(g.unflatten(-1, (-1, head_dim)), A_log, dt_bias=dt_bias) "
    "(fla >= 0.4.1; RFC §6.1.5)"
)

CurrentGate = Callable[..., torch.Tensor]


def old_signature_gate(current_gate: CurrentGate) -> Callable[..., torch.Tensor]:
    """fla 0.4.0's gate call shape, computed by `current_gate` (fla's current signature)."""

    def fused_kda_gate(
        g: torch.Tensor,
        A: torch.Tensor,
        head_k_dim: int,
        g_bias: torch.Tensor | None = None,
        beta: float = 1.0,
        threshold: float = 20.0,
    ) -> torch.Tensor:
        if beta != 1.0 or threshold != 20.0:
            raise ValueError(
                f"fla's current gate has no {beta=} or {threshold=}; only 1.0 and 20.0 carry over"
            )
        if g.shape[-1] % head_k_dim:
            raise ValueError(f"gate input width {g.shape[-1]} is not a multiple of {head_k_dim=}")
        return current_gate(g.unflatten(-1, (-1, head_k_dim)), A, dt_bias=g_bias)

    return fused_kda_gate


def patch_layer_class(modeling: ModuleType, current_gate: CurrentGate) -> type[torch.nn.Module]:
    """A subclass of `modeling.KimiDeltaAttention` whose forward calls its gate through `current_gate`."""
    gate = old_signature_gate(current_gate)

    class KimiDeltaAttentionCurrentGate(modeling.KimiDeltaAttention):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with replaced(modeling, GATE_NAME, gate):
                return super().forward(*args, **kwargs)

    return KimiDeltaAttentionCurrentGate
