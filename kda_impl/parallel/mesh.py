"""The device mesh of the KDA layer: heads over `tensor`, requests over `data`.

A mesh has two named axes (`make_mesh(tp, dp)` builds one):
- `tensor` (TP): every tensor rank holds H / tp heads — their q/k/v/gate/output-gate columns, their conv
  channels, their `A_log` / `dt_bias` / beta rows, their rows of `o_proj` and their recurrent and conv
  states in the pool. The layer's only collective is one sum of the `o_proj` partial products.
- `data` (DP attention): the requests of a step are split across the data ranks; each rank holds its
  own pool slots, with its own dummy slot 0, and its own padded share of the batch.

The mesh may span processes (`jax.distributed`; `kda_impl.parallel.distributed` for CPU hosts): the
layer only ever names the two axes, never a device or a process.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
TENSOR_AXIS = "tensor"
MESH_AXES = (DATA_AXIS, TENSOR_AXIS)


def make_mesh(tp: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data=dp, tensor=tp)` mesh over the first `dp * tp` of `devices` (default: `jax.devices()`,
    the devices of every process, process by process — so a data rank stays within a host when
    tp divides the devices per host).

    The axes are `Auto` (GSPMD) axes: host-side pool updates on sharded buffers stay plain jnp.
    """
    for name, size in (("tp", tp), ("dp", dp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp * dp:
        platform = devices[0].platform if devices else "no"
        raise ValueError(
            f"a mesh of tp={tp} x dp={dp} needs {tp * dp} devices, found {len(devices)} {platform} "
            f"device(s); on a CPU start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * dp}"
        )
    grid = np.asarray(devices[: tp * dp], dtype=object).reshape(dp, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def single_device_mesh() -> Mesh:
    """The 1 x 1 mesh of this process's first device: where a layer built without a mesh runs."""
    return make_mesh(1, 1, jax.local_devices()[:1])


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """`(dp, tp)` of a mesh with the axes `data` and `tensor`, or a ValueError naming its axes."""
    missing = [axis for axis in MESH_AXES if axis not in mesh.shape]
    if missing:
        raise ValueError(
            f"the mesh must have the axes {MESH_AXES} (make one with kda_impl.parallel.make_mesh); "
            f"it has {dict(mesh.shape)}, missing {missing}"
        )
    return mesh.shape[DATA_AXIS], mesh.shape[TENSOR_AXIS]


def check_heads_divisible(num_heads: int, tp: int) -> None:
    """ValueError unless the `tensor` axis size `tp` divides the head count."""
    if num_heads % tp:
        choices = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"num_heads={num_heads} cannot be split over a tensor axis of size tp={tp}: tensor "
            f"parallelism splits whole heads, so tp must divide num_heads (one of {choices})"
        )


def put(
    x: np.ndarray | jax.Array,
    mesh: Mesh,
    spec: PartitionSpec,
) -> jax.Array:
    """`x` (the same host value in every process) laid out on `mesh` as `spec` says."""
    return jax.device_put(x, NamedSharding(mesh, spec))


def fetch(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
