"""Where a run ran, in words: the first lines of a report (terminal and report.md) and the warning for
Pallas kernels that ran in the interpreter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conformance.runtime.matmul_precision import matmul_precision_line
from conformance.runtime.run_platform import recorded_platform

_INTERPRET_WARNING = (
    "WARNING: Pallas ran in interpret mode on {where} ({dtypes}): this says nothing about Mosaic on a TPU"
)


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
    platform = recorded_platform(report)
    if not platform or not platform.get("pallas_interpreted"):
        return None
    return _INTERPRET_WARNING.format(
        where=platform.get("name", "?"), dtypes=", ".join(platform["pallas_interpreted"])
    )


def platform_lines(report: Mapping[str, Any]) -> list[str]:
    """The first lines of a report: where it ran, how the kernels ran, its matmul precision, and the
    interpret warning."""
    platform = recorded_platform(report)
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
