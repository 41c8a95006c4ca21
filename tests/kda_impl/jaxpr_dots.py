"""Every `dot_general` of a traced function, through all its sub-jaxprs, and the ones not at full fp32.

On a TPU an fp32 `dot` at DEFAULT precision is one bf16 pass, on an A100/H100 TF32; only
`Precision.HIGHEST` (or an explicit fp32 algorithm) is fp32 everywhere. A function's jaxpr says which
each dot got, on any machine: `reduced_precision_dots(jax.make_jaxpr(f)(*args))` walks it, and every
sub-jaxpr an equation carries in its parameters (pjit, scan, while, cond's branches, custom_jvp/vjp,
shard_map, remat, and pallas_call's kernel body), and lists the floating-point dots at anything less.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.extend import core

FULL_FP32_PRECISION = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
# Explicit algorithms with fp32 (or wider) operands and accumulation.
FULL_FP32_ALGORITHMS = (jax.lax.DotAlgorithmPreset.F32_F32_F32, jax.lax.DotAlgorithmPreset.F64_F64_F64)


@dataclasses.dataclass(frozen=True)
class Dot:
    """One `dot_general` equation: where it is (the primitives of the jaxprs around it), its operands'
    shapes and dtypes, and its `precision` parameter."""

    path: tuple[str, ...]
    operands: tuple[str, ...]  # "float32[64,128]" each
    precision: Any

    def __str__(self) -> str:
        where = " > ".join(self.path) or "top level"
        return f"dot_general({', '.join(self.operands)}) in {where}: precision={self.precision}"


def _sub_jaxprs(value: Any) -> Iterator[core.Jaxpr]:
    """The jaxprs inside an equation parameter: a Jaxpr, a ClosedJaxpr, or a tuple or list of them."""
    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def dots(jaxpr: core.Jaxpr | core.ClosedJaxpr, path: tuple[str, ...] = ()) -> Iterator[Dot]:
    """Every `dot_general` of `jaxpr` and of every jaxpr nested in its equations' parameters."""
    if isinstance(jaxpr, core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            operands = tuple(f"{var.aval.dtype}{list(var.aval.shape)}" for var in eqn.invars)
            yield Dot(path, operands, eqn.params.get("precision"))
        for name, value in eqn.params.items():
            for sub in _sub_jaxprs(value):
                yield from dots(sub, (*path, f"{eqn.primitive.name}.{name}"))


def is_full_fp32(precision: Any) -> bool:
    """Whether a dot's `precision` parameter computes in fp32 on every platform."""
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision in FULL_FP32_ALGORITHMS
    return isinstance(precision, tuple) and tuple(precision) == FULL_FP32_PRECISION


def _is_floating(operand: str) -> bool:
    return np.issubdtype(np.dtype(operand.split("[")[0]), np.floating)


def reduced_precision_dots(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> list[Dot]:
    """The floating-point dots of `jaxpr` (all nested ones included) not at full fp32 precision; an
    integer dot is exact at any precision."""
    return [
        dot
        for dot in dots(jaxpr)
        if any(_is_floating(operand) for operand in dot.operands) and not is_full_fp32(dot.precision)
    ]
