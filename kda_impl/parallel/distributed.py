"""Joining a multi-process JAX run, so that one mesh spans the devices of every process.

On TPU and GPU slices `jax.distributed.initialize()` finds its peers by itself; `initialize` here is for
the cases that need to be told: CPU hosts (whose collectives then go through gloo over TCP) and local
multi-process tests. Call it before any other JAX call of the process.
"""

from __future__ import annotations

import jax


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_devices_per_process: int | None = None,
) -> None:
    """Join the run coordinated at `coordinator_address` ("host:port") as `process_id`.

    `cpu_devices_per_process`: on a CPU host, how many CPU devices this process contributes; it also
    switches the CPU collectives to gloo (the CPU client has no cross-process collectives otherwise).
    """
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if cpu_devices_per_process is not None:
        if cpu_devices_per_process < 1:
            raise ValueError(f"cpu_devices_per_process must be >= 1, got {cpu_devices_per_process}")
        jax.config.update("jax_num_cpu_devices", cpu_devices_per_process)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
