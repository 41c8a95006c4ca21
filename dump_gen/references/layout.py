"""The reference module's own weight layout, checked against the contract (`kda_spec.weight_names`).

The dump's weights are laid out by the contract's table; the reference layer that consumes them says
by its own parameters what it expects. Reading the layout from the module, not from the table, makes a
wrong entry in the table fail here, with the names and shapes at fault, instead of agreeing with itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from dump_gen.errors import DumpError
from kda_spec.config import KDAConfig
from kda_spec.weight_names import hf_weight_shapes

# A module's parameter arrays (shape-only views) → the same arrays under their HF names.
ToHfNames = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def module_layout(module: torch.nn.Module, to_hf: ToHfNames | None = None) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every parameter of `module`, renamed by `to_hf` when its names differ.

    `to_hf` receives zero-copy, shape-only numpy views, so this costs no memory at the real size.
    """
    views = {name: np.broadcast_to(np.float32(0), tuple(p.shape)) for name, p in module.named_parameters()}
    renamed = to_hf(views) if to_hf is not None else views
    return {name: tuple(array.shape) for name, array in renamed.items()}


def check_layout(reference: str, found: Mapping[str, tuple[int, ...]], config: KDAConfig) -> None:
    """A DumpError naming every parameter where `reference`'s layer and the contract disagree."""
    expected = hf_weight_shapes(config)
    problems = [f"{name}: missing from the reference layer" for name in expected if name not in found]
    problems += [f"{name}: not in the contract" for name in found if name not in expected]
    problems += [
        f"{name}: the reference layer has shape {list(found[name])}, the contract says {list(shape)}"
        for name, shape in expected.items()
        if name in found and tuple(found[name]) != tuple(shape)
    ]
    if problems:
        raise DumpError(
            f"the {reference} reference layer's weights do not match the contract (kda_spec.weight_names) "
            f"at hidden_size={config.hidden_size}, num_heads={config.num_heads}, "
            f"head_dim={config.head_dim}, conv_size={config.conv_size}: " + "; ".join(problems)
        )
