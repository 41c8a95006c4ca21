"""Watching a reference layer compute: its own kernel functions and its output norm, wrapped while it runs.

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
