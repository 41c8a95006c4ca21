"""Whether a dump set's fp32 reference computed in IEEE fp32, from its manifest's `precision` block.

TF32 (a 10-bit mantissa: errors near 1e-3) in the reference makes its fp32 results no fp32 reference:
an fp32 check against them measures the reference, and the absolute limits (impl vs reference) fail a
faithful implementation. The block (docs/dump-format.md) records the settings the reference ran with;
on a CUDA device any of these is TF32: Triton's fp32 `tl.dot` default not `ieee` (where Triton is
installed), `torch.backends.cuda.matmul.allow_tf32` or `torch.backends.cudnn.allow_tf32` on, and on
any device a torch float32 matmul precision below `highest`. A GPU before sm80 has no TF32. A set
without the block (made before it) is IEEE fp32 when its reference ran on a CPU and unknown on a CUDA
device. The report warns on one line about a `tf32` or `unknown` set, and the fp32 checks whose
absolute limits fail say so (`failure_note`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kda_spec import dump_format as fmt

IEEE, TF32, UNKNOWN = "ieee", "tf32", "unknown"
_FIRST_TF32_MAJOR = 8  # sm80 (A100) and later
_CAPABILITY = re.compile(r"[0-9]+\.[0-9]+")
_BOOL_SETTINGS = ("torch_matmul_allow_tf32", "cudnn_allow_tf32")
_STRING_SETTINGS = (
    "triton_f32_default",
    "float32_matmul_precision",
    "device",
    "compute_capability",
    "triton",
)


class PrecisionBlockError(ValueError):
    """A `precision` block whose field has the wrong type; the message names the field and the value."""


@dataclasses.dataclass(frozen=True)
class ReferencePrecision:
    """How the set's fp32 reference computed: `fp32` is IEEE, TF32 or UNKNOWN, `reasons` why."""

    fp32: str
    reasons: tuple[str, ...]

    @property
    def warning(self) -> str | None:
        """The report's one line about a reference that is not IEEE fp32, or None."""
        if self.fp32 == IEEE:
            return None
        verb = "ran with TF32" if self.fp32 == TF32 else "may have run with TF32"
        return (
            f"WARNING: the dump's fp32 reference {verb} ({'; '.join(self.reasons)}): its fp32 results may "
            "be off by ~1e-3, and the fp32 checks against them measure the reference"
        )

    @property
    def failure_note(self) -> str | None:
        """What an fp32 check whose absolute limits fail says first in its failure text, or None."""
        if self.fp32 == IEEE:
            return None
        verb = "ran with TF32" if self.fp32 == TF32 else "may have run with TF32 (precision unrecorded)"
        return f"the fp32 reference {verb}, an error the absolute limits measure too"

    def as_dict(self) -> dict[str, Any]:
        return {"fp32": self.fp32, "reasons": list(self.reasons), "warning": self.warning}


def _checked(block: Any, where: str) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise PrecisionBlockError(f"{where}: 'precision' must be an object, found {block!r}")
    for field in _BOOL_SETTINGS:
        if field in block and not isinstance(block[field], bool):
            raise PrecisionBlockError(
                f"{where}: precision.{field} must be true or false, found {block[field]!r}"
            )
    for field in _STRING_SETTINGS:
        if block.get(field) is not None and not isinstance(block[field], str):
            raise PrecisionBlockError(
                f"{where}: precision.{field} must be a string or null, found {block[field]!r}"
            )
    capability = block.get("compute_capability")
    if capability is not None and not _CAPABILITY.fullmatch(capability):
        raise PrecisionBlockError(
            f'{where}: precision.compute_capability must be MAJOR.MINOR ("9.0") or null, found {capability!r}'
        )
    return block


def _tf32_reasons(block: dict[str, Any]) -> list[str]:
    """What in a recorded `precision` block put TF32 into the fp32 reference (empty: none)."""
    reasons = []
    matmul = block.get("float32_matmul_precision", "highest")
    if matmul != "highest":
        reasons.append(f"torch float32_matmul_precision {matmul!r}")
    capability = block.get("compute_capability")
    has_tf32 = capability is None or int(capability.split(".")[0]) >= _FIRST_TF32_MAJOR
    if not str(block.get("device") or "").startswith("cuda") or not has_tf32:
        return reasons
    triton_default = block.get("triton_f32_default")
    if block.get("triton") is not None and triton_default != fmt.IEEE_TRITON_F32:
        shown = "unset" if triton_default is None else repr(triton_default)
        reasons.append(f"{fmt.TRITON_F32_DEFAULT} {shown}: Triton's fp32 tl.dot in TF32")
    reasons += [f"torch {field} on" for field in _BOOL_SETTINGS if block.get(field, False)]
    return reasons


def reference_precision(manifest: dict[str, Any], where: str) -> ReferencePrecision:
    """The fp32 precision of the set of `manifest` (read from `where`); a PrecisionBlockError for a
    malformed block."""
    if fmt.PRECISION_BLOCK not in manifest:
        reference = manifest.get("reference")
        device = reference.get("device", "") if isinstance(reference, dict) else ""
        if isinstance(device, str) and device.startswith("cuda"):
            return ReferencePrecision(
                UNKNOWN, (f"made on {device} without a 'precision' block in its manifest",)
            )
        return ReferencePrecision(IEEE, ())
    reasons = _tf32_reasons(_checked(manifest[fmt.PRECISION_BLOCK], where))
    return ReferencePrecision(TF32, tuple(reasons)) if reasons else ReferencePrecision(IEEE, ())
