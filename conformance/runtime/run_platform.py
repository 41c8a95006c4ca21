"""What a run really ran on: the platform and devices JAX used and, per run dtype, how the kernels ran.

The report keeps them as `environment.platform` (report.json), with the run's matmul precision and what
DEFAULT means on the platform (`matmul_precision`), says them first (report.md, the terminal
summary: `conformance.reports.platform`), warns loudly when Pallas ran only in its interpreter, and
`gate --require-platform` (or the policy's `[platform] require`) refuses a report made elsewhere or with
interpreted Pallas kernels (`conformance.tools.gate.platform_breaches`).

How a kernel ran is the adapter's `kernel_used` (`pallas (mosaic, tpu)`, `pallas (interpret, cpu)`,
`naive (xla, cpu)`; docs/adapters.md). An adapter that names Pallas without saying how gets what this
module can know for it: on a CPU, Pallas has only its interpreter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from conformance.runtime.host_platform import PLATFORMS
from conformance.runtime.matmul_precision import matmul_precision

REQUIRABLE_PLATFORMS = PLATFORMS  # a gate can require any platform a host can be
_INTERPRETED = re.compile(r"\(\s*interpret\s*,")


def platform_name(backend: str, platform_version: str) -> str:
    """`cpu`, `tpu`, `cuda` or `rocm` (JAX calls both GPU platforms `gpu`), else the backend's name."""
    if backend == "gpu":
        version = platform_version.lower()
        return next((name for name in ("cuda", "rocm") if name in version), backend)
    return backend


def jax_platform() -> dict[str, Any]:
    """The platform JAX runs on here: its name, JAX's backend, the devices' kind and count, the
    processes, the platform's version string, and a GPU's compute capability ("9.0" for an H100)."""
    import jax

    devices = jax.devices()
    backend = jax.default_backend()
    version = devices[0].client.platform_version
    found = {
        "name": platform_name(backend, version),
        "backend": backend,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "platform_version": version,
    }
    capability = getattr(devices[0], "compute_capability", None)
    return found if capability is None else {**found, "compute_capability": str(capability)}


def kernel_execution(kernel_used: str, platform: str) -> str:
    """How the kernels ran: `kernel_used` as the adapter says it, but a plain `pallas` on a CPU is
    `pallas (interpret, cpu)`, the only way Pallas runs there."""
    if kernel_used.strip().lower() == "pallas" and platform == "cpu":
        return "pallas (interpret, cpu)"
    return kernel_used


def is_interpreted(execution: str) -> bool:
    """Whether `execution` (a `kernel_execution`) has Pallas kernels that ran in the interpreter."""
    return _INTERPRETED.search(execution) is not None


def platform_block(
    kernel_used: Mapping[str, str], platform: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """report.json's `environment.platform`: `platform` (default: `jax_platform()`), the run's matmul
    precision and what DEFAULT means there (`matmul_precision`), how the kernels ran per run dtype
    (`kernels`), and the dtypes whose Pallas kernels were interpreted."""
    block = dict(jax_platform() if platform is None else platform)
    block.setdefault("matmul_precision", matmul_precision(block["name"], block.get("compute_capability")))
    kernels = {dtype: kernel_execution(used, block["name"]) for dtype, used in kernel_used.items()}
    block["kernels"] = kernels
    block["pallas_interpreted"] = [dtype for dtype, execution in kernels.items() if is_interpreted(execution)]
    return block


def check_required_platform(value: Any, name: str) -> str:
    """`value` if it names a platform a gate can require, else a ValueError naming it."""
    if value not in REQUIRABLE_PLATFORMS:
        raise ValueError(f"{name} must be one of {list(REQUIRABLE_PLATFORMS)}, got {value!r}")
    return value


def recorded_platform(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The report's `environment.platform`, or None where it has none."""
    environment = report.get("environment")
    platform = environment.get("platform") if isinstance(environment, Mapping) else None
    return platform if isinstance(platform, Mapping) else None
