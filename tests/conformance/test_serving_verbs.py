"""The serving protocol's optional verbs on golden's weights: kda_impl passes short scenarios of each
(copy, verify and accept, handoff, poisoned slots), each seeded defect of a verb passes a schedule of the
verbs before them and fails the short scenario of its verb, and an adapter without a verb has the
scenarios that need it skipped with the reason. The fixed scenarios of the verbs run in `make conform`."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapter import ServingAdapter, provided_calls
from conformance.adapters import serving_defects
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSkipped
from conformance.checks.runner import CheckRunner
from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_events import (
    Accept,
    Copy,
    Handoff,
    Poison,
    alloc,
    decode,
    extend,
    free,
    verify,
)
from conformance.checks.serving_invariance import batch_invariance, invariance_scenarios
from conformance.checks.serving_scenarios import Scenario, fixed_scenarios, load_scenarios
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from tests.conformance.test_serving import GOLDEN, _search

SLOTS = 4
SHORT = {
    # a snapshot after 5 tokens, its source going on; a new request from the snapshot
    "copy": [
        *alloc("p", "s"), extend(("p", 5)), Copy("p", "s"), extend(("p", 3)), decode("p"),
        *alloc("q"), Copy("s", "q"), extend(("q", 2)), decode("q", "p"),
    ],
    "verify": [
        *alloc("v", "w"), extend(("v", 5), ("w", 3)), verify(("v", 3), ("w", 2), padding_rows=1),
        Accept("v", 2), Accept("w", 0), decode("v", "w"),
    ],
    "handoff": [
        *alloc("a", "b"), extend(("a", 6), ("b", 2)), Handoff(("b", "a")), decode("a"), decode("a", "b"),
    ],
    "poison": [
        *alloc("x0", "x1", "x2", "x3"),
        Poison("x0", "nan"), Poison("x1", "1e30"), Poison("x2", "nan"), Poison("x3", "1e30"),
        *free("x3", "x2", "x1", "x0"),  # a last-in-first-out pool hands x0's slot out again
        *alloc("a", "z"), extend(("a", 3), ("z", 2), padding_rows=1), decode("a", padding_rows=1),
    ],
    # the verbs before them: recycled slots, padding rows, a decode beside a prefill
    "plain": [
        *alloc("a", "b", "z"), extend(("a", 5), ("b", 3), ("z", 2), padding_rows=1), *free("a"), *alloc("c"),
        extend(("c", 4), ("b", 1), padding_rows=2), decode("b", "c", padding_rows=1),
    ],
}  # fmt: skip


def results(adapter_class: type[ServingAdapter], names: list[str], dtype: str = "fp32") -> dict[str, str]:
    """Each serving check of the short scenarios `names`: "passed", "failed" or "skipped: <why>"."""
    runner = CheckRunner(DumpSet(str(GOLDEN)), adapter_class, "auto", TolerancePolicy.load())
    scenarios = [Scenario(f"short-{name}", SLOTS, tuple(SHORT[name])) for name in names]
    serving = ServingChecks(runner, scenarios, "short")
    found = {}
    for spec in serving.plan([dtype]):
        try:
            found[spec.check] = "passed" if serving.run(spec).comparison.passed else "failed"
        except CheckSkipped as skip:
            found[spec.check] = f"skipped: {skip}"
    return found


def test_kda_impl_provides_every_verb_and_passes_each_short_scenario():
    assert {"serving_copy", "serving_load", "serving_accept"} <= provided_calls(KDAImplAdapter)
    found = results(KDAImplAdapter, ["copy", "verify", "handoff", "poison"])
    assert set(found.values()) == {"passed"}, found
    assert "serving-short-poison-poisoned" in found
    # the copy scenario's snapshot holds a copy and processes nothing: its checkpoint, judged on its own
    assert {"serving-short-copy-checkpoint", "serving-short-copy-checkpoint-conv"} <= set(found)


@pytest.mark.parametrize(
    ("defect", "scenario", "caught_by"),
    [
        (serving_defects.SnapshotAfterPartialChunk, "copy", "serving-short-copy-checkpoint"),
        (serving_defects.AcceptForgetsConvShift, "verify", "serving-short-verify-conv"),
        (serving_defects.HandoffRepeatsLastToken, "handoff", "serving-short-handoff-state"),
        (serving_defects.PaddingWrapsToLastSlot, "poison", "serving-short-poison-poisoned"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_each_seeded_defect_of_a_verb_hides_from_the_verbs_before_and_fails_its_scenario(
    defect, scenario, caught_by
):
    found = results(defect, ["plain", scenario])
    assert all(found[check] == "passed" for check in found if "-plain" in check), found
    assert found[caught_by] == "failed", found


class NoVerbs(KDAImplAdapter):
    name = "kda_impl without the optional verbs"
    serving_copy = ServingAdapter.serving_copy
    serving_load = ServingAdapter.serving_load
    serving_accept = ServingAdapter.serving_accept


def test_an_adapter_without_a_verb_has_the_scenarios_that_need_it_skipped_with_the_reason():
    assert not {"serving_copy", "serving_load", "serving_accept"} & provided_calls(NoVerbs)
    found = results(NoVerbs, ["copy", "handoff", "verify"])
    reason = (
        "skipped: adapter 'kda_impl without the optional verbs' implements no {} (optional verb(s) of "
        "the serving protocol, conformance.adapter.ServingAdapter)"
    )
    for scenario, verb in (
        ("copy", "serving_copy"),
        ("handoff", "serving_load"),
        ("verify", "serving_accept"),
    ):
        assert found[f"serving-short-{scenario}"] == reason.format(verb), found


def test_batch_invariance_is_measured_and_reported_not_gated(capsys):
    runner = CheckRunner(DumpSet(str(GOLDEN)), KDAImplAdapter, "auto", TolerancePolicy.load())
    serving = ServingChecks(runner, list(invariance_scenarios(SLOTS)), "invariance")
    measured = batch_invariance(serving, "fp32")
    print(measured.describe())
    assert measured.tokens == 4 and 0 <= measured.identical <= 4 and np.isfinite(measured.max_abs)
    assert measured.bit_identical == (measured.max_abs == 0.0)
    assert "batch invariance: " in capsys.readouterr().out
    # whatever the bits, each schedule is correct within the gates
    assert all(
        serving.run(spec).comparison.passed
        for spec in serving.plan(["fp32"])
        if "untouched" not in spec.check
    )


@pytest.mark.parametrize(
    ("defect", "event_type"),
    [
        (serving_defects.SnapshotAfterPartialChunk, Copy),
        (serving_defects.AcceptForgetsConvShift, Accept),
        (serving_defects.HandoffRepeatsLastToken, Handoff),
        (serving_defects.PaddingWrapsToLastSlot, Poison),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_a_short_search_of_the_verbs_finds_each_seeded_defect_and_writes_a_replayable_schedule(
    tmp_path, defect, event_type
):
    """Each defect of a verb is found by drawing that verb's events (the shrunk schedule keeps one)."""
    code, report = _search(tmp_path, defect, budget_s=150.0, shrink_budget_s=5.0)
    assert code == 1 and report["found"], report
    (found,) = load_scenarios(tmp_path / "scenarios.json")
    assert any(isinstance(event, event_type) for event in found.events), found
    assert "--scenarios" in report["found"]["replay"]


def test_the_prefix_hit_snapshots_are_its_checkpoints_with_two_checks_per_dtype():
    prefix_hit = next(scenario for scenario in fixed_scenarios() if scenario.name == "prefix-hit")
    assert prefix_hit.checkpoints == ("s64", "s128")  # the hits q and r copy and go on: not checkpoints
    runner = CheckRunner(DumpSet(str(GOLDEN)), KDAImplAdapter, "auto", TolerancePolicy.load())
    named = [spec.id for spec in ServingChecks(runner, [prefix_hit], "fixed").plan(["fp32", "bf16"])]
    assert [name for name in named if "checkpoint" in name] == [
        f"fixed-{dtype}-serving-prefix-hit-{kind}"
        for dtype in ("fp32", "bf16")
        for kind in ("checkpoint", "checkpoint-conv")
    ]
