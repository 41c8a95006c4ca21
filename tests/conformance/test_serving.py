"""The serving checks on golden's weights: kda_impl passes the fixed scenarios, each seeded defect fails
the scenario made for it, an adapter without a serving path has them skipped, a bad scenario file is one
clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conformance.adapter import KDAAdapter, LayerAdapter, LayerResult
from conformance.adapters import serving_defects
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSkipped
from conformance.checks.runner import CheckRunner
from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_scenarios import (
    fixed_scenarios,
    load_scenarios,
    scenario_set_name,
    write_scenarios,
)
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.search.command import SearchOptions
from conformance.search.serving_search import run_serving_search
from kda_impl.server_args import MIXED_CHUNK_EVIDENCE

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def serving_results(adapter_class: type[KDAAdapter], names: list[str], dtype: str = "fp32") -> dict[str, str]:
    """Each serving check of the fixed scenarios `names`: "passed", "failed" or "skipped: <why>"."""
    dumps = DumpSet(str(GOLDEN))
    runner = CheckRunner(dumps, adapter_class, "auto", TolerancePolicy.load())
    scenarios = [scenario for scenario in fixed_scenarios() if scenario.name in names]
    serving = ServingChecks(runner, scenarios, "fixed")
    results = {}
    for spec in serving.plan([dtype]):
        try:
            results[spec.check] = "passed" if serving.run(spec).comparison.passed else "failed"
        except CheckSkipped as skip:
            results[spec.check] = f"skipped: {skip}"
    return results


def test_kda_impl_passes_every_fixed_scenario():
    names = [scenario.name for scenario in fixed_scenarios()]
    results = serving_results(KDAImplAdapter, names)
    assert set(results.values()) == {"passed"}, results
    assert {f"serving-{name}" for name in names} <= set(results)
    assert set(MIXED_CHUNK_EVIDENCE) <= set(results)  # the evidence ServerArgs cites exists


@pytest.mark.parametrize(
    ("defect", "scenario", "caught_by"),
    [
        (serving_defects.StaleRecycledSlot, "recycled-slot", "serving-recycled-slot"),
        (serving_defects.OneTokenSegmentAsNew, "one-token-extend", "serving-one-token-extend-state"),
        (serving_defects.OneTokenConvLookbackZeros, "one-token-extend", "serving-one-token-extend-conv"),
        (serving_defects.ShiftedDecodeSlots, "mixed-extend", "serving-mixed-extend"),
        (serving_defects.PaddingWritesSlot, "padding-rows", "serving-padding-rows-untouched"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_each_seeded_defect_fails_its_scenario(defect, scenario, caught_by):
    results = serving_results(defect, [scenario])
    assert results[caught_by] == "failed", results


class LayerOnly(LayerAdapter):
    name = "layer only"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None) -> LayerResult:
        return LayerResult(out=np.zeros_like(hidden_states))

    def layer_decode(self, hidden_states, carry) -> LayerResult:
        raise NotImplementedError("layer only: no decode path")


def test_an_adapter_without_a_serving_path_has_the_checks_skipped_with_the_reason():
    results = serving_results(LayerOnly, ["one-token-prompt"])
    reason = "adapter 'layer only' implements no serving protocol (conformance.adapter.ServingAdapter)"
    assert set(results.values()) == {f"skipped: {reason}"}


def test_a_scenario_file_round_trips_and_names_its_stem(tmp_path):
    path = tmp_path / "found-1.json"
    write_scenarios(fixed_scenarios(), path)
    assert load_scenarios(path) == fixed_scenarios()
    assert scenario_set_name(path) == "found_1" and scenario_set_name(None) == "fixed"


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"free": "x"}, r"event 1: free 'x', which holds no slot"),
        (
            {"forward": {"mode": "decode", "requests": [["a", 2]]}},
            r"'a' has 2 tokens; extend needs >= 1, decode 1",
        ),
        (
            {"forward": {"mode": "mixed", "requests": [["a", 1]]}},
            r"mode must be one of \['extend', 'decode'\]",
        ),
        ({"forward": {"mode": "extend", "requests": [["b", 1]]}}, r"request 'b' holds no slot"),
    ],
)
def test_a_bad_scenario_is_one_line_naming_the_value(tmp_path, event, message):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps({"scenarios": [{"name": "s", "num_slots": 2, "events": [{"alloc": "a"}, event]}]})
    )
    with pytest.raises(ValueError, match=message):
        load_scenarios(path)


def _search(
    tmp_path: Path, adapter_class: type[KDAAdapter], budget_s: float, shrink_budget_s: float = 5.0
) -> tuple[int, dict]:
    options = SearchOptions(
        impl=adapter_class.__name__, adapter_class=adapter_class, options={}, kernel="auto",
        policy=TolerancePolicy.load(), dumps=str(GOLDEN), dtypes=("fp32",), budget_s=budget_s, seed=0,
        out=tmp_path, max_tokens=16, shrink_budget_s=shrink_budget_s,
    )  # fmt: skip
    code = run_serving_search(options)
    return code, json.loads((tmp_path / "serving-search.json").read_text())


def test_the_serving_search_finds_a_seeded_defect_and_writes_a_replayable_shrunk_schedule(tmp_path):
    code, report = _search(
        tmp_path, serving_defects.OneTokenSegmentAsNew, budget_s=90.0, shrink_budget_s=60.0
    )
    assert code == 1 and report["found"], report
    (found,) = load_scenarios(tmp_path / "scenarios.json")
    assert len(found.request_tokens) <= 2 and len(found.forwards) <= 3, found  # shrunk
    assert "--scenarios" in report["found"]["replay"]


def test_the_serving_search_finds_nothing_on_kda_impl_within_a_short_budget(tmp_path):
    code, report = _search(tmp_path, KDAImplAdapter, budget_s=10.0)
    assert code == 0 and report["found"] is None and report["schedules_tried"] > 0, report
    assert not (tmp_path / "scenarios.json").exists()
