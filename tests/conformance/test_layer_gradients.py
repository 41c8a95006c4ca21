"""Training conformance at the layer: kda_impl's layer gradients (`layer-grad-*`) against the float64
layer's vector-Jacobian product (kda_spec.layer_vjp), and its gradient causality (`layer-grad-causal`),
on both families; seeded defects (tests/conformance/layer_gradient_adapters.py) failing them."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.judging.verdict import worst_ratio
from conformance.policy import TolerancePolicy
from tests.conformance import layer_gradient_adapters
from tests.conformance.test_serving import GOLDEN

POLICY = TolerancePolicy.load()
GRADIENT_CHECKS = (
    Check(kinds.LAYER_GRAD_X),
    Check(kinds.LAYER_GRAD_H0),
    *(Check(kinds.LAYER_GRAD_WEIGHT, name) for name in kinds.LAYER_GRADIENT_WEIGHTS),
)
CAUSAL = Check(kinds.LAYER_GRAD_CAUSAL)
CASE = "varlen_initstate"  # a packed batch from initial states, one sequence of one token


def _results(adapter: type, dumps: DumpSet, checks, dtype: str = "fp32") -> dict[str, object]:
    runner = CheckRunner(dumps, adapter, "auto", POLICY)
    return {check.name: runner.run(CheckSpec(CASE, dtype, check)).comparison for check in checks}


@pytest.mark.parametrize("dumps", [GOLDEN, GOLDEN.parent / "golden-glm5-next"], ids=lambda path: path.name)
def test_kda_impls_layer_gradients_pass_on_both_families(dumps) -> None:
    """Every layer gradient (the input's, the initial states', each weight's: a fused conv's by thirds)
    within the relative gate of the float64 truth, and the backward causal to the bit."""
    found = _results(KDAImplAdapter, DumpSet(str(dumps)), (*GRADIENT_CHECKS, CAUSAL))
    assert not {name: c.failures for name, c in found.items() if not c.passed}
    ratios = [worst_ratio(c.attribution.criteria) for c in found.values() if c.attribution is not None]
    assert len(ratios) == len(GRADIENT_CHECKS) and max(ratios) < 1


def test_a_bf16_layer_gradient_without_a_dumped_reference_is_skipped() -> None:
    """golden stores the reference's gradients for its cases of <= 65 tokens: T128 has none."""
    runner = CheckRunner(DumpSet(str(GOLDEN)), KDAImplAdapter, "auto", POLICY)
    with pytest.raises(CheckSkipped, match="no bf16 reference of the layer's gradients"):
        runner.run(CheckSpec("T128", "bf16", Check(kinds.LAYER_GRAD_X)))


def test_a_decay_parameters_gradient_one_percent_off_fails_its_check_alone() -> None:
    found = _results(layer_gradient_adapters.ALogGradientScaled, DumpSet(str(GOLDEN)), GRADIENT_CHECKS)
    assert [name for name, c in found.items() if not c.passed] == ["layer-grad-A_log"]
    failed = found["layer-grad-A_log"]
    assert failed.attribution.blame == "impl" and worst_ratio(failed.attribution.criteria) > 100


def test_a_layer_that_reads_the_next_token_breaks_gradient_causality() -> None:
    found = _results(
        layer_gradient_adapters.LookAheadLayer, DumpSet(str(GOLDEN)), (CAUSAL, Check(kinds.LAYER_GRAD_X))
    )
    assert not found[CAUSAL.name].passed and not found["layer-grad-x"].passed


@pytest.mark.torch
def test_a_bf16_weight_gradient_whose_terms_cancel_is_held_to_its_spread(tmp_path) -> None:
    """golden's varlen_unbalanced_5_17_1_41 (made again here, with the reference's gradients), bf16: A_log's
    gradient is 2 values, each a sum of T·D terms that cancel; kda_impl's is 1.4e-2 from the truth (nRMSE),
    transformers' under autograd 4.9e-3. Over 20 draws of the inputs the two are alike (median 5.7e-3 and
    5.3e-3; each beyond twice the other in 3 of 20): the reference drew a small rounding. Against the
    reference alone the check fails; held to the gradient's spread (tolerances.toml
    `gradient_spread_lambda`) it passes, the spread named as its reference."""
    from dump_gen.cli import main

    case = "varlen_unbalanced_5_17_1_41"
    out = tmp_path / "set"
    assert main(["--out", str(out), "--preset", "mini", "--cases", case, "--no-progress"]) == 0
    dumps = DumpSet(str(out))
    spec = CheckSpec(case, "bf16", Check(kinds.LAYER_GRAD_WEIGHT, "A_log"))
    without = dataclasses.replace(
        POLICY,
        relative={
            **POLICY.relative,
            "bf16": dataclasses.replace(POLICY.relative["bf16"], gradient_spread_lambda=0),
        },
    )
    assert not CheckRunner(dumps, KDAImplAdapter, "auto", without).run(spec).comparison.passed
    held = CheckRunner(dumps, KDAImplAdapter, "auto", POLICY).run(spec).comparison
    assert held.passed, held.failures
    nrmse = next(c for c in held.attribution.criteria if c.statistic == "nRMSE vs truth")
    assert "gradient, every element moved by 2" in nrmse.reference_source


def test_under_pallas_kernels_the_layer_gradients_are_skipped_with_the_reason() -> None:
    runner = CheckRunner(DumpSet(str(GOLDEN)), KDAImplAdapter, "pallas", POLICY)
    with pytest.raises(CheckSkipped, match="Pallas kernels have no backward"):
        runner.run(CheckSpec(CASE, "fp32", Check(kinds.LAYER_GRAD_X)))
