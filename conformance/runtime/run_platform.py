"""What a run really ran on: the platform and devices JAX used and, per run dtype, how the kernels ran.

The report keeps them as `environment.platform` (report.json), with the run's matmul precision and what
DEFAULT means on the platform (`matmul_precision`), says them first (report.md, the terminal
summary), warns loudly when Pallas ran only in its interpreter, and `gate --require-platform` (or the
policy's `[platform] require`) refuses a report made elsewhere or with interpreted Pallas kernels.

How a kernel ran is the adapter's `kernel_used` (`pallas (mosaic, tpu)`, `pallas (interpret, cpu)`,
`naive (xla, cpu)`; docs/adapters.md). An adapter that names Pallas without saying how gets what this
module can know for it: on a CPU, Pallas has only its interpreter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from conformance.runtime.host_platform import PLATFORMS
from conformance.runtime.matmul_precision import matmul_precision, matmul_precision_line

REQUIRABLE_PLATFORMS = PLATFORMS  # a gate can require any platform a host can be
_INTERPRETED = re.compile(r"\(\s*interpret\s*,")
_INTERPRET_WARNING = (
    "WARNING: Pallas ran in interpret mode on {where} ({dtypes}): this says nothing about Mosaic on a TPU"
)


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


def _recorded(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The report's `environment.platform`, or None where it has none."""
    environment = report.get("environment")
    platform = environment.get("platform") if isinstance(environment, Mapping) else None
    return platform if isinstance(platform, Mapping) else None


def devices_label(platform: Mapping[str, Any]) -> str:
    """`tpu, TPU v5 lite ×4` or `cpu, cpu ×1`: the platform, the kind and count of its devices."""
    name, kind, count = (platform.get(key, "?") for key in ("name", "device_kind", "device_count"))
    label = f"{name}, {kind} ×{count}"
    processes = platform.get("process_count", 1)
    return label if processes == 1 else f"{label} in {processes} processes"


def _kernels_label(kernels: Mapping[str, str]) -> str:
    """`pallas (mosaic, tpu) (fp32, bf16)` when every dtype ran alike, else each dtype's."""
    if len(set(kernels.values())) == 1:
        return f"{next(iter(kernels.values()))} ({', '.join(kernels)})"
    return "; ".join(f"{dtype}: {execution}" for dtype, execution in kernels.items()) or "none ran"


def interpret_warning(report: Mapping[str, Any]) -> str | None:
    """The warning for a run whose Pallas kernels ran in the interpreter, or None."""
    platform = _recorded(report)
    if not platform or not platform.get("pallas_interpreted"):
        return None
    return _INTERPRET_WARNING.format(
        where=platform.get("name", "?"), dtypes=", ".join(platform["pallas_interpreted"])
    )


def platform_lines(report: Mapping[str, Any]) -> list[str]:
    """The first lines of a report: where it ran, how the kernels ran, its matmul precision, and the
    interpret warning."""
    platform = _recorded(report)
    if platform is None:
        return ["platform: not recorded in this report"]
    lines = [
        f"platform: {devices_label(platform)} (JAX backend {platform.get('backend', '?')})",
        f"kernels: {_kernels_label(platform.get('kernels', {}))}",
    ]
    precision = platform.get("matmul_precision")
    if isinstance(precision, Mapping):  # reports made before it have none
        lines.append(matmul_precision_line(precision))
    warning = interpret_warning(report)
    return lines if warning is None else [*lines, warning]


def platform_markdown(report: Mapping[str, Any]) -> list[str]:
    """`platform_lines` for report.md: a list, and the warning in bold after it."""
    lines = platform_lines(report)
    warning = interpret_warning(report)
    shown = [f"- {line}" for line in lines if line != warning]
    return shown if warning is None else [*shown, "", f"**{warning}**"]


def check_required_platform(value: Any, name: str) -> str:
    """`value` if it names a platform a gate can require, else a ValueError naming it."""
    if value not in REQUIRABLE_PLATFORMS:
        raise ValueError(f"{name} must be one of {list(REQUIRABLE_PLATFORMS)}, got {value!r}")
    return value


def platform_breaches(report: Mapping[str, Any], required: str) -> list[str]:
    """Why the report was not made on `required`, one line per reason: another platform, no record of
    one, or Pallas kernels that ran in the interpreter (recomputed from the recorded `kernels`; accepted
    when `required` is `cpu`, where Pallas has nothing else)."""
    platform = _recorded(report)
    if platform is None:
        return [f"platform: required {required}, but the report records none (environment.platform)"]
    found = []
    if platform.get("name") != required:
        found.append(f"platform: required {required}, the report was made on {devices_label(platform)}")
    kernels = platform.get("kernels", {})
    if not isinstance(kernels, Mapping) or not all(isinstance(k, str) for k in kernels.values()):
        return [*found, f"platform: 'kernels' must map each dtype to a string, found {kernels!r}"]
    interpreted = {
        dtype: execution
        for dtype, execution in kernels.items()
        if is_interpreted(kernel_execution(execution, str(platform.get("name"))))
    }
    if required != "cpu":
        found += [
            f"platform: required {required}, but the {dtype} kernels ran {execution}: Pallas interpreted, "
            "never compiled"
            for dtype, execution in interpreted.items()
        ]
    return found
