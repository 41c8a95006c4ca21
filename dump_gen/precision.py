"""The reference's fp32 is IEEE fp32: no TF32 in Triton's `tl.dot`, torch's matmuls or cuDNN.

On an sm80+ GPU (A100, H100) three defaults would put TF32 (a 10-bit mantissa, ~1e-3 error) into an
fp32 dump: Triton's fp32 `tl.dot` (fla's kernels) unless `TRITON_F32_DEFAULT=ieee`, cuDNN's convolutions
(`torch.backends.cudnn.allow_tf32`, on by default) and torch's matmuls when their precision is lowered.
`use_ieee_fp32` turns all three off; `python -m dump_gen` calls it before torch, triton or fla is
imported (Triton reads the variable when it compiles a kernel). A `TRITON_F32_DEFAULT` already in the
environment is kept, so that a TF32 dump can still be made on purpose (`benchmarks/device_check.sh`
compares the two); the manifest's `precision` block (`precision_block`) records what the run really
had, read back after it, and the checker warns about an fp32 set that ran with TF32.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

from kda_spec.dump_format import IEEE_TRITON_F32, TRITON_F32_DEFAULT


def use_ieee_fp32() -> None:
    """IEEE fp32 for the fp32 torch and Triton arithmetic of this process ($TRITON_F32_DEFAULT if set)."""
    os.environ.setdefault(TRITON_F32_DEFAULT, IEEE_TRITON_F32)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _triton_f32_default() -> str | None:
    """Triton's fp32 `tl.dot` default as Triton itself reads it (None: unset, or no Triton installed)."""
    try:
        from triton import knobs
    except ImportError:
        return os.environ.get(TRITON_F32_DEFAULT)
    return knobs.language.fp32_default


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def precision_block(device: str) -> dict[str, Any]:
    """The manifest's `precision` block: the settings above as they are now, torch's and triton's versions
    and the device (`cuda`: its name and compute capability)."""
    import torch

    cuda = device == "cuda"
    return {
        "triton_f32_default": _triton_f32_default(),
        "torch_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "torch": torch.__version__,
        "triton": _version("triton"),
    }
