"""kda_impl with every matmul summed in one fixed, faithful fp32 order, the same bits on every machine: the
products of a dot rounded to fp32, accumulated in `lanes` interleaved partial sums (as SIMD accumulators
sum), then the lanes in order; in numpy (separate multiplies and adds, no fused multiply-add) through
`jax.pure_callback`. XLA:CPU's own dot sums in an order of its machine's vector width and blocking; these
do not depend on it, so a test of faithful implementations that are lucky or unlucky on a case gets the
same errors everywhere (docs/tolerance-policy.md, "The reductions' spread")."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from kda_impl.models.kimi_linear import KimiDeltaAttention


def lane_ordered_matmul(
    lhs: np.ndarray,  # [T, K] float32
    rhs: np.ndarray,  # [K, N] float32
    lanes: int,
) -> np.ndarray:
    """`lhs @ rhs` [T, N] in float32: the K products of each dot rounded, summed in `lanes` lanes (lane l
    takes the products l, l + lanes, ...), then lane 0 + lane 1 + ... in that order."""
    lhs, rhs = np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)
    partial = np.zeros((lanes, lhs.shape[0], rhs.shape[1]), np.float32)
    for index in range(lhs.shape[1]):
        partial[index % lanes] += lhs[:, index, None] * rhs[None, index, :]
    total = partial[0].copy()
    for lane in partial[1:]:
        total += lane
    return total


def lane_ordered_dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, *args: Any, lanes: int, **kwargs: Any
) -> jax.Array:
    """`lax.dot_general` of a `[T, K] x [K, N]` fp32 matmul (the layer's every one) as `lane_ordered_matmul`;
    a ValueError for any other contraction."""
    if dimension_numbers != (((1,), (0,)), ((), ())) or lhs.ndim != 2 or rhs.ndim != 2:
        raise ValueError(f"lane_ordered_dot_general takes [T, K] x [K, N] only, got {dimension_numbers}")
    result = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[1]), np.float32)
    return jax.pure_callback(functools.partial(lane_ordered_matmul, lanes=lanes), result, lhs, rhs)


@functools.cache
def lane_ordered(lanes: int) -> type[KDAImplAdapter]:
    """kda_impl with its projections and o_proj summed in `lanes` lanes (module docstring): faithful."""
    layer = type(
        f"LaneOrderedLayer{lanes}",
        (KimiDeltaAttention,),
        {"dot_general": staticmethod(functools.partial(lane_ordered_dot_general, lanes=lanes))},
    )
    return type(
        f"LaneOrderedMatmuls{lanes}",
        (KDAImplAdapter,),
        {"name": f"kda_impl, matmuls summed in {lanes} lane(s)", "layer_class": layer},
    )
