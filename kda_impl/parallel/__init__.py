"""Tensor and data parallelism of the KDA layer (docs/parallelism.md)."""

from kda_impl.parallel.mesh import (
    DATA_AXIS,
    MESH_AXES,
    TENSOR_AXIS,
    check_heads_divisible,
    fetch,
    make_mesh,
    mesh_sizes,
    put,
    single_device_mesh,
)

__all__ = [
    "DATA_AXIS",
    "MESH_AXES",
    "TENSOR_AXIS",
    "check_heads_divisible",
    "fetch",
    "make_mesh",
    "mesh_sizes",
    "put",
    "single_device_mesh",
]
