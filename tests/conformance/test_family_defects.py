"""The second family's seeded defects (tests/conformance/family_defects.py): each passes a Kimi-Linear
set and fails a lower-bound one made at L = -3, where `diff` names the gate `g` as the first stage out
of tolerance; the built-in kda_impl passes the same lower-bound set; a short search finds each."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSpec
from conformance.checks.kinds import LAYER, Check
from conformance.policy import TolerancePolicy
from conformance.search.dumpcase import CASE_ID
from conformance.search.explore import explore
from conformance.search.judge import Judge
from conformance.search.space import case_strategy
from conformance.search.weight_sets import weight_sets
from conformance.tools.diff import first_out_of_tolerance, run_stages
from tests.conformance.family_case_sets import GLM_AT_MINUS_THREE, KIMI, check_runner, write_case_sets
from tests.conformance.family_defects import FAMILY_DEFECTS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def case_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """One-case sets (65 + 30 tokens) of Kimi-Linear and of GLM at L = -3, by (family, run)."""
    return write_case_sets(tmp_path_factory, ((KIMI, "fp32"), (GLM_AT_MINUS_THREE, "fp32")), (65, 30))


@pytest.mark.parametrize("defect", FAMILY_DEFECTS, ids=lambda d: d.__name__)
def test_each_defect_passes_kimi_and_fails_glm_at_the_gate(defect, case_sets) -> None:
    layer = CheckSpec(CASE_ID, "fp32", Check(LAYER))
    assert check_runner(case_sets["kimi-linear", "fp32"], defect).run(layer).comparison.passed
    glm = check_runner(case_sets["glm5-next", "fp32"], defect)
    assert not glm.run(layer).comparison.passed
    first = first_out_of_tolerance(run_stages(glm, CASE_ID, "fp32"))
    assert first is not None and first.result == "g", first


def test_the_built_in_implementation_passes_the_lower_bound_set(case_sets) -> None:
    runner = check_runner(case_sets["glm5-next", "fp32"], KDAImplAdapter)
    assert first_out_of_tolerance(run_stages(runner, CASE_ID, "fp32")) is None


@pytest.mark.parametrize("defect", FAMILY_DEFECTS, ids=lambda d: d.__name__)
def test_a_short_search_over_the_families_finds_each_defect(defect) -> None:
    """The search draws the family and the bound itself: no set names the lower-bound layer."""
    sets = weight_sets(None, "mini", 0, defect.FAMILIES)
    judge = Judge(defect, "auto", {}, TolerancePolicy.load(), sets)
    strategy = case_strategy(("fp32",), list(sets), max_tokens=64, max_seqs=2)
    finding = explore(judge.judge, strategy, budget_s=120, seed=0, shrink_budget_s=5).finding
    assert finding is not None and finding.check == "g", finding
    assert sets[finding.case.weights].config.family == "glm5-next"
