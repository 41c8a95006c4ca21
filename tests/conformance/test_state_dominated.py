"""Issue 23's case for the bf16 precision contract: one sequence of 97 tokens from an initial state, the
hidden states 1e-3 of unit scale, so that the carried state dominates the output.

The issue reports kda_impl failing the contract there (nRMSE vs the model 3.35e-3, gain +1.5e-4) while
the truth says `conditioning`. Rebuilt with the project's tools (dump_gen's transformers reference and
this set's numpy reference, the mini and the real preset), kda_impl stays as close to the model as on
golden — a flip here and there — and a moved rounding still fails it: the contract holds in this regime.
"""

from __future__ import annotations

import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSpec
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.judging.comparison import Comparison
from conformance.judging.verdict import worst_ratio
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import contract_record
from kda_spec import dump_format as fmt
from kda_spec.config import get_preset
from tests.conformance.broken_adapters import BetaInBf16
from tests.conformance.synthetic import write_dump_set

CASE = fmt.CaseSpec("T97_initstate_small", (97,), initial_state=True)
HIDDEN_STD = 1e-3  # the "hidden states x 1e-3"
LAYER_CHECKS = ("layer", "layer-state", "o_norm", "chunked-prefill")


@pytest.fixture(scope="module")
def state_dominated(tmp_path_factory: pytest.TempPathFactory) -> DumpSet:
    root = tmp_path_factory.mktemp("state-dominated")
    config = get_preset("mini")
    return DumpSet(str(write_dump_set(root, (CASE,), config=config, dtypes=("bf16",), hidden_std=HIDDEN_STD)))


def _checked(dumps: DumpSet, adapter: type, check: str) -> Comparison:
    runner = CheckRunner(dumps, adapter, "auto", TolerancePolicy.load())
    return runner.run(CheckSpec(CASE.case_id, "bf16", check)).comparison


@pytest.mark.parametrize("check", LAYER_CHECKS)
def test_kda_impl_keeps_the_contract_when_the_state_dominates(state_dominated: DumpSet, check: str) -> None:
    comparison = _checked(state_dominated, KDAImplAdapter, check)
    contract = comparison.contract
    assert comparison.passed, comparison.failures
    assert contract.gating.applies and not contract.closer
    assert worst_ratio(contract.criteria) < 0.5, contract_record(contract)


def test_a_moved_rounding_still_fails_the_contract_when_the_state_dominates(state_dominated: DumpSet) -> None:
    """beta's sigmoid in bf16 (against a reference that rounds as transformers does, the relative gate
    cannot see it: the truth says `conditioning`; this set's reference does not round it)."""
    comparison = _checked(state_dominated, BetaInBf16, "beta")
    assert not comparison.passed and worst_ratio(comparison.contract.criteria) > 1, contract_record(
        comparison.contract
    )
