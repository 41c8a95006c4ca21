"""The bf16 precision contract: its float64 model, its two measures (nRMSE and gain), how it decides a
check in the `relative+contract` mode, that `gate` recomputes it, and its policy's validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSpec
from conformance.checks.runner import CheckRunner
from conformance.checks.truth import FP32_STAGES, computed_contract_model
from conformance.dumps.reader import DumpSet
from conformance.judging.attribution import attribute
from conformance.judging.comparison import Comparison, judge
from conformance.judging.contract import contract_check, error_vs_contract
from conformance.judging.limits import ContractLimits, RelativeLimits, Tolerance
from conformance.judging.verdict import CONTRACT_MODE, unmet, worst_ratio
from conformance.policy import DEFAULT_POLICY_FILE, TolerancePolicy
from conformance.reports.check_record import metrics
from conformance.reports.report import Record
from conformance.tools.diff import run_stages, table_lines
from conformance.tools.gate import ReportError, breaches
from tests.conformance import broken_adapters
from tests.conformance.absolute import compare
from tests.conformance.policy_files import edited_policy
from tests.conformance.report_files import criterion, report_of

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
BF16, RFC = Tolerance(atol=1e-2, rtol=1e-2), Tolerance(atol=1e-3, rtol=1e-3)
RELATIVE = RelativeLimits(factor=2.0, margin_floor=0.5, nrmse_floor=1e-4)
LIMITS = ContractLimits(
    max_nrmse=2e-3, max_nrmse_fp32_stage=5e-4, max_gain=1e-4, closer_factor=2.0, spread_factor=2.0
)
MIN_TOKENS = 32
STATE_AXES = ("seq", "head", "key", "value")
MODEL = np.random.default_rng(0).normal(size=(64, 48))


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


# ------------------------------------------------------------------------------------ the model


def test_the_model_rounds_every_bf16_stage_and_keeps_the_fp32_ones() -> None:
    dumps = DumpSet(str(GOLDEN))
    case = dumps.case("T65")
    model = computed_contract_model(case, dumps.weights(), dumps.config)
    for name, value in model.items():
        on_the_bf16_grid = bool(np.all(_bf16(value) == value))
        assert on_the_bf16_grid == (name not in FP32_STAGES), name


def test_kda_impl_matches_the_model_almost_bit_for_bit_on_golden() -> None:
    """The evidence behind the limits: every stage of kda_impl's bf16 run is within a few one-ulp flips."""
    dumps = DumpSet(str(GOLDEN))
    runner = CheckRunner(dumps, KDAImplAdapter, "auto", TolerancePolicy.load())
    comparison = runner.run(CheckSpec("T65", "bf16", "q_after_conv")).comparison
    assert comparison.contract is not None and comparison.contract.impl.nrmse == 0.0
    layer = runner.run(CheckSpec("T65", "bf16", "layer")).comparison
    assert layer.contract.gating.applies and layer.contract.impl.nrmse < 0.25 * LIMITS.max_nrmse
    assert abs(layer.contract.impl.gain) < 0.1 * LIMITS.max_gain
    # transformers, golden's reference, rounds the conv twice: it is recorded, and does not decide.
    assert comparison.contract.reference.nrmse > LIMITS.max_nrmse and comparison.passed


# ---------------------------------------------------------------------------------- the measures


def test_the_gain_of_a_scaled_result_is_the_scale_and_independent_roundings_have_none() -> None:
    assert error_vs_contract(MODEL * (1 + 3e-4), MODEL).gain == pytest.approx(3e-4, rel=1e-9)
    rounded = error_vs_contract(_bf16(MODEL), MODEL)
    assert rounded.nrmse > 1e-3 and abs(rounded.gain) < 1e-4
    nan = MODEL.copy()
    nan[1, 2] = np.nan
    assert error_vs_contract(nan, MODEL).nrmse == np.inf


def _contract_judged(
    actual: np.ndarray,
    fp32_stage: bool = False,
    model: np.ndarray = MODEL,
    truth: np.ndarray = MODEL,
    min_tokens: int = MIN_TOKENS,
    axes: tuple[str, ...] = ("token", "channel"),
    seq_lens: tuple[int, ...] | None = None,
) -> Comparison:
    """`actual` against a bf16 reference, the `truth`, and the contract's `model`."""
    reference = _bf16(truth)
    comparison = compare(actual, reference, BF16, RFC, axes, seq_lens=seq_lens, min_tokens=min_tokens)
    attribution = attribute(actual, reference, truth, "t", BF16, RELATIVE, bool(comparison.absolute_failures))
    impl_error = attribution.impl.nrmse
    contract = contract_check(
        actual, reference, model, truth, impl_error, "t", LIMITS, fp32_stage, comparison.measurement.gating
    )
    return judge(comparison.measurement, CONTRACT_MODE, attribution, contract=contract)


def test_a_scale_below_the_relative_gate_fails_the_contract_by_its_gain() -> None:
    judged = _contract_judged(MODEL * (1 + 5e-4))
    assert not unmet(judged.attribution.criteria) and judged.judged_by == CONTRACT_MODE
    assert not judged.passed and judged.failures == [
        "precision contract: gain vs the contract's model +0.0005, |gain| > 0.0001"
    ]
    assert judged.gate_ratio == pytest.approx(5.0)


def test_a_rounding_the_contract_does_not_have_fails_an_fp32_stage_by_its_nrmse() -> None:
    judged = _contract_judged(_bf16(MODEL), fp32_stage=True)
    assert not judged.passed and "nRMSE vs the contract's model" in judged.failures[0]
    assert _contract_judged(_bf16(MODEL), fp32_stage=False).passed  # the same rounding in a bf16 stage


def test_a_result_closer_to_the_truth_than_the_model_is_exempt() -> None:
    """Rounding less than the contract is no defect: sgl-jax keeps the b_proj logit in fp32 (its beta
    is 5.1e-4 off the model, over the limit, and 4e-8 off the truth, where the model is 5.1e-4 off)."""
    rounded_model = _bf16(MODEL)
    exact = _contract_judged(MODEL.copy(), fp32_stage=True, model=rounded_model)
    assert exact.contract.impl.nrmse > LIMITS.max_nrmse_fp32_stage and exact.contract.closer
    assert exact.passed and worst_ratio(exact.contract.criteria) == 0.0
    nearer = MODEL + 0.6 * (rounded_model - MODEL)  # 1.7x closer to the truth than the model: not exempt
    judged = _contract_judged(nearer, fp32_stage=True, model=rounded_model)
    assert not judged.contract.closer and not judged.passed


def test_the_contract_is_not_gated_below_min_tokens_nor_without_a_model() -> None:
    few = _contract_judged(MODEL * (1 + 5e-4), min_tokens=len(MODEL) + 1)
    assert few.passed and not few.contract.gating.applies and worst_ratio(few.contract.criteria) == 0.0
    comparison = compare(MODEL * (1 + 5e-4), _bf16(MODEL), BF16, RFC, ("token", "channel"))
    attribution = attribute(MODEL * (1 + 5e-4), _bf16(MODEL), MODEL, "t", BF16, RELATIVE, False)
    alone = judge(comparison.measurement, CONTRACT_MODE, attribution, no_contract="no model of this result")
    assert alone.passed and alone.judged_by == "relative"
    assert metrics(alone)["contract"] == {"available": False, "reason": "no model of this result"}


def test_golden_catches_beta_rounded_to_bf16_although_its_reference_rounds_it_too() -> None:
    runner = CheckRunner(DumpSet(str(GOLDEN)), broken_adapters.BetaInBf16, "auto", TolerancePolicy.load())
    beta = runner.run(CheckSpec("T65", "bf16", "beta")).comparison
    assert beta.attribution.blame == "conditioning" and not unmet(beta.attribution.criteria)
    assert not beta.passed and beta.failures[0].startswith("precision contract: nRMSE")


# ------------------------------------------------------------------------------------------ gate


def _passed_record() -> dict[str, Any]:
    comparison = _contract_judged(MODEL * (1 + 5e-5))
    assert comparison.passed
    return Record(CheckSpec("T65", "bf16", "layer"), "passed", "", 0.1, comparison).as_dict(0.5)


NRMSE, GAIN = "nRMSE vs the contract", "|gain|"


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda c: criterion(c, GAIN).update(value=3e-4), "|gain| vs the contract's model 0.0003 > 0.0001"),
        (lambda c: criterion(c, NRMSE).update(value=0.01), "nRMSE vs the contract's model 0.01 > 0.002"),
        (lambda c: criterion(c, NRMSE).update(value=1e-3, floor=5e-4), "0.001 > 0.0005"),
    ],
)
def test_the_gate_recomputes_the_contract_from_the_recorded_numbers(tamper, reason: str) -> None:
    check = _passed_record()
    assert breaches(report_of([check])) == []
    tamper(check)
    found = breaches(report_of([check]))
    assert len(found) == 1 and reason in found[0], found


def test_the_gate_refuses_a_contract_bound_of_zero() -> None:
    check = _passed_record()
    criterion(check, GAIN).update(floor=0)
    with pytest.raises(ReportError, match=r"has the bound 0\.0: not > 0"):
        breaches(report_of([check]))


def test_the_gate_does_not_gate_a_contract_recorded_over_too_few_tokens() -> None:
    check = _passed_record()
    for statistic in (NRMSE, GAIN):
        criterion(check, statistic).update(tokens=8, value=1.0)
    assert breaches(report_of([check])) == []


# ---------------------------------------------------------------------------------------- policy


def test_the_default_policy_holds_the_layer_results_of_bf16_to_the_contract() -> None:
    policy = TolerancePolicy.load()
    assert policy.contract == LIMITS
    for check in ("layer", "layer-state", "q_after_conv", "beta", "decode-k8", "chunked-prefill"):
        assert policy.mode(check, "bf16") == CONTRACT_MODE, check
        assert policy.mode(check, "fp32") != CONTRACT_MODE, check
    assert policy.mode("kernel-chunk", "bf16") == "relative"


def test_a_policy_without_the_contract_mode_needs_no_contract_table(tmp_path: Path) -> None:
    """A policy file written before the contract still loads; one whose rules use it needs the table."""
    text = DEFAULT_POLICY_FILE.read_text()
    table = text[text.index("[contract.bf16]") : text.index("spread_factor = 2.0")]
    without = text.replace(table, "").replace("spread_factor = 2.0", "", 1)
    path = tmp_path / "old.toml"
    path.write_text(without.replace('mode = "relative+contract"', 'mode = "relative"'))
    policy = TolerancePolicy.load(path)
    assert policy.contract is None and policy.mode("layer", "bf16") == "relative"
    path.write_text(without)
    with pytest.raises(ValueError, match=r"missing table \[contract.bf16\] \(a \[\[mode\]\] rule uses"):
        TolerancePolicy.load(path)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("max_gain = 1e-4", "max_gain = 0", r"\[contract.bf16\]: max_gain must be a finite number > 0"),
        ("closer_factor = 2.0", "closer_factor = 0.5", r"closer_factor must be >= 1, got 0.5"),
        ("max_gain = 1e-4", "max_gains = 1e-4", r"missing \['max_gain'\], unknown \['max_gains'\]"),
        ("[contract.bf16]", "[contract.fp32]", r"only \[contract.bf16\]"),
        (
            'check = "kernel-*"\ndtype = "bf16"\nmode = "relative"',
            'check = "kernel-*"\ndtype = "fp32"\nmode = "relative+contract"',
            r"mode 'relative\+contract' is for dtype 'bf16' only",
        ),
    ],
)
def test_a_bad_contract_policy_names_the_entry(tmp_path: Path, old: str, new: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TolerancePolicy.load(edited_policy(tmp_path, old, new))


def test_diff_names_the_first_stage_off_the_contract() -> None:
    runner = CheckRunner(DumpSet(str(GOLDEN)), broken_adapters.BetaInBf16, "auto", TolerancePolicy.load())
    lines = table_lines(run_stages(runner, "T65", "bf16"))
    assert lines[-1].startswith("first stage off the precision contract: gate/beta (beta): nRMSE vs")
    conv = next(line for line in lines if line.startswith("conv") and "q_after_conv" in line)
    assert " 0 / +0 " in conv  # bit-exact against the contract's model, as kda_impl itself


def test_the_contract_counts_each_state_by_its_own_sequence_as_the_nrmse_gate_does() -> None:
    """One minimum-tokens rule: the states of sequences shorter than `min_tokens` are left out of the
    contract's statistics exactly as they are left out of the bf16 nRMSE gate's."""
    states = np.random.default_rng(1).normal(size=(4, 2, 4, 4))
    seq_lens = (5, 17, 1, 41)
    short_off = states.copy()
    short_off[:3] *= 1 + 5e-3  # the three short sequences' states scaled: ungated
    judged = _contract_judged(short_off, True, states, states, axes=STATE_AXES, seq_lens=seq_lens)
    assert judged.contract.gating.tokens == judged.measurement.gating.tokens == 41
    assert (
        list(judged.contract.gating.rows)
        == list(judged.measurement.gating.rows)
        == [False, False, False, True]
    )
    assert judged.contract.impl.nrmse == 0.0 and not unmet(judged.contract.criteria)
    long_off = states.copy()
    long_off[3] *= 1 + 5e-4
    judged = _contract_judged(long_off, True, states, states, axes=STATE_AXES, seq_lens=seq_lens)
    assert unmet(judged.contract.criteria) == ["gain vs the contract's model +0.0005, |gain| > 0.0001"]
