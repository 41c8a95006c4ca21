"""Naming a reduced-precision matmul from the numbers: an fp32 result whose error matches a float64
model of the layer with every projection's operands rounded (one bf16 pass, or TF32) rather than the
float64 truth.

On a TPU, JAX's DEFAULT precision for an fp32 dot is one bf16 pass; on an A100/H100 it is TF32. An
implementation that leaves `precision=` out passes every CPU run and fails fp32 on the accelerator by
orders of magnitude. The matmul of such a run is, to fp32 accumulation, the exact product of its rounded
operands: so its result is within fp32 rounding of the model that rounds them (kda_spec.truth's
`operand`), and ~1e-3 (bf16) or ~1e-4 (TF32) from the truth. A faithful fp32 result is ~1e-7 from the
truth and as far from either model as the truth is: it is never diagnosed. The decision is the numbers'
alone, not the platform's: an fp32 check whose implementation is `CLOSER_FACTOR` times closer (nRMSE)
to a model than to the truth gets that model's name and fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from conformance.judging.measurement import normalised_rmse

# The implementation must be this many times closer to a model than to the truth. A reduced-precision
# pass puts it ~1e3x closer (measured: tests/conformance/test_matmul_diagnosis.py), a faithful fp32 run
# ~1e3x further.
CLOSER_FACTOR = 4.0


@dataclasses.dataclass(frozen=True)
class MatmulModel:
    """A reduced-precision matmul: its operands' explicit mantissa bits, what it is, and the fix."""

    name: str
    mantissa_bits: int
    means: str
    fix: str


MATMUL_MODELS = (
    MatmulModel(
        "bf16-pass",
        7,
        "one bf16 pass per matmul (JAX's DEFAULT precision on a TPU)",
        "set precision=HIGHEST on every fp32 dot, or run under jax.default_matmul_precision('highest')",
    ),
    MatmulModel(
        "tf32",
        10,
        "TF32 matmuls (JAX's DEFAULT precision on an A100/H100; torch or Triton TF32)",
        "set precision=HIGHEST (JAX), or turn TF32 off (torch.backends.cuda.matmul.allow_tf32 = False, "
        "TRITON_F32_DEFAULT=ieee)",
    ),
)


@dataclasses.dataclass(frozen=True)
class MatmulDiagnosis:
    """An fp32 result that matches `model`: its nRMSE against the model and against the truth."""

    model: MatmulModel
    nrmse_vs_model: float
    nrmse_vs_truth: float

    def text(self) -> str:
        return (
            f"the errors match {self.model.means} (nRMSE {self.nrmse_vs_model:.2g} against that model, "
            f"{self.nrmse_vs_truth:.2g} against the truth): {self.model.fix}"
        )


def diagnose(
    actual: np.ndarray, truth: np.ndarray, models: Mapping[str, np.ndarray]
) -> MatmulDiagnosis | None:
    """The model of `MATMUL_MODELS` (by name in `models`, each of `actual`'s shape) that `actual` matches
    (module docstring), the closest where several do; None where none does."""
    a, t = np.asarray(actual, np.float64), np.asarray(truth, np.float64)
    if not np.all(np.isfinite(a)):
        return None
    from_truth = normalised_rmse(np.abs(a - t), t)
    found = None
    for model in MATMUL_MODELS:
        if model.name not in models:
            continue
        m = np.asarray(models[model.name], np.float64)
        from_model = normalised_rmse(np.abs(a - m), m)
        if from_model * CLOSER_FACTOR <= from_truth and (found is None or from_model < found.nrmse_vs_model):
            found = MatmulDiagnosis(model, from_model, from_truth)
    return found
