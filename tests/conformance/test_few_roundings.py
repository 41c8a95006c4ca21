"""Issue 49's case: `conformance search` on kda_impl (fp32, seed 2) flagged `layer-state` on three sequences
at scale 100, shrunk to [366, 80, 62]. Strong decay leaves the second sequence's final state to its last
token's update, so one beta decides it: a logit of 0.19 from terms whose |x_i w_i| sum to 631. Whichever
faithful fp32 order sums that dot, its rounding (a few 2^-24 · 631) is the state's error, and the
reference's error is one draw of it. kda_impl was no less accurate: the float64 recurrence on its own
stages is as far off as it is, and its beta projection's error over the case is 0.34 units of
2^-24 · sum |x_i w_i| against numpy's 0.47 (docs/tolerance-policy.md, "The reductions' spread").

The case is generated here as `search` writes it (the seed-2 synthetic mini weights), so its reference is
this machine's numpy; the lucky and unlucky sides of the gate are fixed summation orders
(`summation_orders`), the same bits on every machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec, case_checks
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.judging.attribution import error_vs_truth, relative_criteria
from conformance.judging.verdict import decide, worst_ratio
from conformance.policy import TolerancePolicy
from conformance.search.dumpcase import CASE_ID, write_case_set
from conformance.search.judge import Judge
from conformance.search.space import SearchCase
from conformance.search.weight_sets import weight_sets
from tests.conformance.broken_adapters import state_scaled
from tests.conformance.summation_orders import lane_ordered

CASE = SearchCase("fp32", "synthetic", (366, 80, 62), "zero", 2, "natural", "natural", 4597)
WEIGHTS_SEED = 2  # the search's --seed: the synthetic weights it draws
POLICY = TolerancePolicy.load()
STATE = CheckSpec(CASE_ID, "fp32", Check(kinds.LAYER_STATE))
KERNEL_STATE = CheckSpec(CASE_ID, "fp32", Check(kinds.LAYER_KERNEL_STATE))
# Two fixed faithful orders of the layer's matmuls: on the deciding dot (token 445, head 1) 4 lanes err by
# +0.97 units of 2^-24 · sum |x_i w_i|, 5 lanes by -0.02 (1 lane: -0.08; this CPU's XLA: +0.67).
UNLUCKY_LANES, LUCKY_LANES = 4, 5


@pytest.fixture(scope="module")
def shrunk_case(tmp_path_factory: pytest.TempPathFactory) -> DumpSet:
    weight_set = weight_sets(None, "mini", WEIGHTS_SEED, KDAImplAdapter.FAMILIES)[CASE.weights]
    root = Path(tmp_path_factory.mktemp("issue49")) / "set"
    write_case_set(str(root), CASE, weight_set.weights, weight_set.config, weight_set.source, {})
    return DumpSet(str(root))


def _state_errors(dumps: DumpSet, adapter: type[KDAImplAdapter]):
    """`adapter`'s layer-state: its runner, case, sides, truth and its error against the truth."""
    runner = CheckRunner(dumps, adapter, "auto", POLICY)
    case = runner.case(CASE_ID)
    sides = runner.sides(case, STATE)
    truth, _ = runner.truth(case, STATE, sides)
    return (
        runner,
        case,
        sides,
        truth,
        error_vs_truth(sides.actual, truth, POLICY.tolerance(STATE.check, "fp32")),
    )


def test_the_search_no_longer_flags_the_case() -> None:
    sets = weight_sets(None, "mini", WEIGHTS_SEED, KDAImplAdapter.FAMILIES)
    verdict = Judge(KDAImplAdapter, "auto", {}, POLICY, sets).judge(CASE)
    assert not verdict.flagged
    assert max(j.ratio for j in verdict.checks.values()) < 1, {n: j.ratio for n, j in verdict.checks.items()}


def test_kda_impl_holds_the_relative_gate_on_every_check_of_the_case(shrunk_case: DumpSet) -> None:
    """Every check's relative gate holds (a bit-exact one holds), and no check blames kda_impl. The RFC's
    absolute 1e-5 against the reference does not hold on the layer's output and state: at scale 100 two
    faithful fp32 pipelines are up to 1.6 times that limit apart there, as `conformance run` reports
    beside the truth's attribution (neither side clearly further)."""
    runner = CheckRunner(shrunk_case, KDAImplAdapter, "auto", POLICY)
    relative_failures, blamed = {}, {}
    for check in case_checks(CASE.seq_lens):
        comparison = runner.run(CheckSpec(CASE_ID, "fp32", check)).comparison
        if comparison.attribution is None:  # a bit-exact check (causality): no truth, it must hold
            if not comparison.passed:
                relative_failures[check.name] = comparison.failures
            continue
        if not decide("relative", comparison.attribution.criteria).passed:
            relative_failures[check.name] = comparison.failures
        if comparison.attribution.blame == "impl":
            blamed[check.name] = comparison.failures
    assert not relative_failures and not blamed


def test_one_beta_decides_the_state_and_the_spread_says_so(shrunk_case: DumpSet) -> None:
    runner, case, sides, truth, _ = _state_errors(shrunk_case, KDAImplAdapter)
    limits = runner.relative_limits(case, STATE, POLICY.tolerance(STATE.check, "fp32"), truth, sides)
    spread = limits.spread
    assert spread is not None and spread.draws == 8
    assert spread.roundings < 2 and spread.tail > 1.5  # one dot (and a little more) decides
    # the spread's root mean square is the error of a deciding dot off by half a unit: 2.8e-6 here
    assert 1e-6 < spread.rms_nrmse < 5e-6


def test_a_lucky_faithful_order_makes_an_unlucky_one_fail_without_the_spread_only(
    shrunk_case: DumpSet,
) -> None:
    runner, case, sides, truth, unlucky = _state_errors(shrunk_case, lane_ordered(UNLUCKY_LANES))
    *_, lucky = _state_errors(shrunk_case, lane_ordered(LUCKY_LANES))
    tolerance = POLICY.tolerance(STATE.check, "fp32")
    limits = runner.relative_limits(case, STATE, tolerance, truth, sides)
    assert unlucky.nrmse > 5 * lucky.nrmse  # 5.0e-6 against 2.4e-7 on the CPU
    without_spread = decide(
        "relative", relative_criteria(unlucky, lucky, dataclasses.replace(limits, spread=None))
    )
    assert not without_spread.passed and without_spread.ratio() > 2
    with_spread = decide("relative", relative_criteria(unlucky, lucky, limits))
    assert with_spread.passed and with_spread.ratio() < 0.8
    assert runner.run(KERNEL_STATE).comparison.passed  # the unlucky order's kernel path is exact


def test_a_state_off_by_twice_its_own_error_fails_the_layer_kernel_state(shrunk_case: DumpSet) -> None:
    """The defect issue 49 holds the change to: the layer's final state scaled by (1 + 2·its own error)
    hides under `layer-state` where one rounding decides it, and fails `layer-kernel-state` by far."""
    *_, own = _state_errors(shrunk_case, KDAImplAdapter)
    runner = CheckRunner(shrunk_case, state_scaled(1 + 2 * own.nrmse), "auto", POLICY)
    result = runner.run(KERNEL_STATE).comparison
    assert not result.passed
    assert result.attribution.blame == "impl" and worst_ratio(result.attribution.criteria) > 5
    assert CheckRunner(shrunk_case, KDAImplAdapter, "auto", POLICY).run(KERNEL_STATE).comparison.passed


def test_the_layer_kernel_state_needs_the_layers_kernel_inputs(shrunk_case: DumpSet) -> None:
    class NoIntermediates(KDAImplAdapter):
        name = "kda_impl without intermediates"

        def layer_extend(self, *args, **kwargs):
            return dataclasses.replace(super().layer_extend(*args, **kwargs), intermediates={})

    runner = CheckRunner(shrunk_case, NoIntermediates, "auto", POLICY)
    with pytest.raises(CheckSkipped, match="does not expose its kernel inputs"):
        runner.run(KERNEL_STATE)
    assert decide("relative", runner.run(STATE).comparison.attribution.criteria).passed
