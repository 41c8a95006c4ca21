"""The second family's seeded defects (tests/conformance/family_defects.py): each passes a Kimi-Linear
set and fails a lower-bound one made at L = -3, where `diff` names the gate `g` as the first stage out
of tolerance; the built-in kda_impl passes the same lower-bound set; a short search finds each."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSpec
from conformance.checks.kinds import LAYER, Check
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.search.dumpcase import CASE_ID, write_case_set
from conformance.search.explore import explore
from conformance.search.judge import Judge
from conformance.search.space import SearchCase, case_strategy
from conformance.search.weight_sets import weight_sets
from conformance.tools.diff import first_out_of_tolerance, run_stages
from tests.conformance.family_defects import FAMILY_DEFECTS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FAMILIES = {"kimi-linear", "glm5-next"}


@pytest.fixture(scope="module")
def case_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-case sets (65 + 30 tokens, small initial states) of Kimi-Linear and of GLM at L = -3."""
    sets = weight_sets(None, "mini", 0, FAMILIES)
    folders = {}
    for name in ("synthetic", "glm5-next@L-3/synthetic"):
        folder = tmp_path_factory.mktemp("family") / "set"
        weight_set = sets[name]
        case = SearchCase("fp32", name, (65, 30), init="small")
        write_case_set(str(folder), case, weight_set.weights, weight_set.config, weight_set.source, {})
        folders[weight_set.config.family] = folder
    return folders


def _runner(folder: Path, adapter_class: type) -> CheckRunner:
    return CheckRunner(DumpSet(str(folder)), adapter_class, "auto", TolerancePolicy.load(), {})


@pytest.mark.parametrize("defect", FAMILY_DEFECTS, ids=lambda d: d.__name__)
def test_each_defect_passes_kimi_and_fails_glm_at_the_gate(defect, case_sets) -> None:
    layer = CheckSpec(CASE_ID, "fp32", Check(LAYER))
    assert _runner(case_sets["kimi-linear"], defect).run(layer).comparison.passed
    glm = _runner(case_sets["glm5-next"], defect)
    assert not glm.run(layer).comparison.passed
    first = first_out_of_tolerance(run_stages(glm, CASE_ID, "fp32"))
    assert first is not None and first.result == "g", first


def test_the_built_in_implementation_passes_the_lower_bound_set(case_sets) -> None:
    runner = _runner(case_sets["glm5-next"], KDAImplAdapter)
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
