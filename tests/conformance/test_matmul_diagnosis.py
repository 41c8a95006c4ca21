"""The reduced-precision matmul diagnosis: kda_impl with its matmul operands rounded as one bf16 pass or
TF32 rounds them (what JAX's DEFAULT precision computes on a TPU or an H100) fails fp32 and is named; a
faithful fp32 run is never named."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSpec
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.judging.matmul_diagnosis import CLOSER_FACTOR, diagnose
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import metrics, summary
from kda_impl.models.kimi_linear import KimiDeltaAttention

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
CHECKS = ("layer", "q_after_conv", "o_norm", "decode-k1")


def rounded_operands_dot_general(
    lhs: jax.Array, rhs: jax.Array, *args: Any, mantissa_bits: int, **kwargs: Any
):
    """`lax.dot_general` of both operands rounded to `mantissa_bits` (fp32's exponent): a reduced pass."""

    def rounded(x: jax.Array) -> jax.Array:
        return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=mantissa_bits)

    return jax.lax.dot_general(rounded(lhs), rounded(rhs), *args, **kwargs)


class _Bf16PassLayer(KimiDeltaAttention):
    dot_general = staticmethod(functools.partial(rounded_operands_dot_general, mantissa_bits=7))


class _Tf32Layer(KimiDeltaAttention):
    dot_general = staticmethod(functools.partial(rounded_operands_dot_general, mantissa_bits=10))


class Bf16PassMatmuls(KDAImplAdapter):
    name = "defect: one bf16 pass per matmul"
    layer_class = _Bf16PassLayer


class Tf32Matmuls(KDAImplAdapter):
    name = "defect: TF32 matmuls"
    layer_class = _Tf32Layer


@pytest.fixture(scope="module")
def golden() -> DumpSet:
    return DumpSet(str(GOLDEN))


@pytest.mark.parametrize(("adapter_class", "model"), [(Bf16PassMatmuls, "bf16-pass"), (Tf32Matmuls, "tf32")])
def test_reduced_precision_matmuls_fail_fp32_and_are_named(
    golden: DumpSet, adapter_class, model: str
) -> None:
    runner = CheckRunner(golden, adapter_class, "auto", TolerancePolicy.load())
    for check in CHECKS:
        comparison = runner.run(CheckSpec("T65", "fp32", check)).comparison
        assert not comparison.passed, check
        assert comparison.blame == "impl", check
        diagnosis = comparison.matmul_diagnosis
        assert diagnosis is not None and diagnosis.model.name == model, (check, diagnosis)
        assert diagnosis.nrmse_vs_model * CLOSER_FACTOR <= diagnosis.nrmse_vs_truth
        assert "likely cause: the errors match" in summary(comparison)
        assert metrics(comparison)["matmul_diagnosis"]["model"] == model


def test_a_faithful_fp32_run_is_never_named(golden: DumpSet) -> None:
    runner = CheckRunner(golden, KDAImplAdapter, "auto", TolerancePolicy.load())
    case = runner.case("T65")
    for check in CHECKS:
        spec = CheckSpec("T65", "fp32", check)
        comparison = runner.run(spec).comparison
        assert comparison.passed and comparison.matmul_diagnosis is None
        sides = runner.sides(case, spec)
        truth, _ = runner.truth(case, spec, sides)
        # asked directly, the diagnosis names nothing either: the run is ~1e3x closer to the truth
        assert runner.matmul_diagnosis(case, spec, sides, truth) is None


def test_diagnose_needs_the_result_clearly_closer_to_the_model() -> None:
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(1000)
    model = truth + 1e-3 * rng.standard_normal(1000)
    near_model = model + 1e-7 * rng.standard_normal(1000)
    between = (truth + model) / 2
    assert diagnose(near_model, truth, {"bf16-pass": model}).model.name == "bf16-pass"
    assert diagnose(between, truth, {"bf16-pass": model}) is None
    assert diagnose(truth + 1e-7, truth, {"bf16-pass": model, "tf32": model}) is None
    assert diagnose(np.full(1000, np.nan), truth, {"bf16-pass": model}) is None
