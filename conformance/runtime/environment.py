"""Where a run ran, as its report records it: device, versions, host, and how each dtype's kernels ran."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

from conformance.runtime.run_platform import platform_block
from kda_spec.extras import installed_versions

_VERSIONED_PACKAGES = ("kda-conformance", "jax", "jaxlib", "flax", "numpy", "ml_dtypes")


def environment(kernel_used: Mapping[str, str]) -> dict[str, Any]:
    """Device and versions of the run, and the platform it ran on with how each dtype's kernels ran
    (`platform`: conformance/runtime/run_platform.py)."""
    import jax

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "devices": [str(device) for device in devices],
        "python": platform.python_version(),
        "platform": platform_block(kernel_used),
        "host": platform.platform(),
        "versions": installed_versions(_VERSIONED_PACKAGES),
    }
