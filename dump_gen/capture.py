"""Watching a reference layer compute: its own kernel functions, its output norm and its gate's input
projection, wrapped or hooked while it runs.

The intermediates of a dump are what the reference itself passed along, taken at the call boundaries of
its own functions and submodules, never recomputed by a second implementation that could hide its
behaviour.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kda_spec.families import KDAFamily

# The canonical names of a KDA kernel's inputs, in call order.
KERNEL_INPUTS = ("q", "k", "v", "g", "beta")


@contextlib.contextmanager
def replaced(owner: object, name: str, replacement: Any) -> Iterator[None]:
    """`owner.name` is `replacement` inside the block, and what it was before after it."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@dataclasses.dataclass
class KernelCall:
    """One call of the layer to a kernel: which path, and q, k, v, g, beta exactly as passed."""

    path: str
    inputs: dict[str, torch.Tensor]


class KernelRecorder:
    """Collects the kernel calls of a layer, in order."""

    def __init__(self) -> None:
        self.calls: list[KernelCall] = []

    def wrap(self, path: str, fn: Callable[..., Any], arg_names: tuple[str, ...]) -> Callable[..., Any]:
        """`fn`, recording each call as `path`; `arg_names` are fn's names for q, k, v, g, beta."""
        signature = inspect.signature(fn)

        def recording(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            self.calls.append(
                KernelCall(path, {name: bound[arg] for name, arg in zip(KERNEL_INPUTS, arg_names)})
            )
            return fn(*args, **kwargs)

        return recording


@dataclasses.dataclass
class NormCall:
    """One call of the layer's gated output norm: its gate (before the sigmoid) and its result."""

    gate: torch.Tensor
    output: torch.Tensor


@contextlib.contextmanager
def recording_norm(module: torch.nn.Module, calls: list[NormCall]) -> Iterator[None]:
    """Appends a NormCall to `calls` for every call of `module(x, gate)` inside the block."""
    signature = inspect.signature(module.forward)

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        gate = list(signature.bind(*args, **kwargs).arguments.values())[1]
        calls.append(NormCall(gate, output))

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


# The canonical name of the gate's second projection, whose output is the raw gate `g_raw` (before
# dt_bias and the activation).
GATE_INPUT_WEIGHT = "f_b_proj.weight"


def gate_input_module(family: KDAFamily, module_name: Callable[[str], str] = str) -> str:
    """The name, in a reference layer, of the module whose output is the raw gate: the module of the
    family's checkpoint name of `f_b_proj.weight` (`forget_gate.f_b_proj` for GLM-5.3-Flash), mapped by
    `module_name` (checkpoint name → the layer's parameter name) where the layer renames it."""
    return module_name(family.checkpoint_name(GATE_INPUT_WEIGHT)).removesuffix(".weight")


@contextlib.contextmanager
def recording_output(layer: torch.nn.Module, name: str, outputs: list[torch.Tensor]) -> Iterator[None]:
    """Appends the output of every call of `layer`'s submodule `name` inside the block to `outputs`, as
    the module returned it (the raw gate: `[1, T, P]` in the run's dtype)."""

    def hook(_module: torch.nn.Module, _args: tuple, output: torch.Tensor) -> None:
        outputs.append(output)

    handle = layer.get_submodule(name).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
