"""The serving checks on golden's weights: kda_impl passes the fixed scenarios, each seeded defect fails
the scenario made for it, an adapter without a serving path has them skipped, a bad scenario file is one
clear error."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from conformance.adapter import (
    OPTIONAL_SERVING_CALLS,
    KDAAdapter,
    LayerAdapter,
    LayerResult,
    ServingAdapter,
    provided_calls,
)
from conformance.adapters import serving_defects
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.catalogue import CheckSkipped
from conformance.checks.runner import CheckRunner
from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_events import (
    EVENT_TYPES,
    Accept,
    Alloc,
    Copy,
    Event,
    Forward,
    Free,
    Handoff,
    Poison,
    ScheduleBook,
    decode,
    event_from_dict,
    extend,
    verify,
)
from conformance.checks.serving_run import HiddenStatistics, ScenarioDriver, scenario_inputs
from conformance.checks.serving_scenarios import (
    Scenario,
    fixed_scenarios,
    load_scenarios,
    scenario_set_name,
    write_scenarios,
)
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.search.command import SearchOptions
from conformance.search.serving_search import run_serving_search
from conformance.search.serving_space import schedule
from kda_impl.server_args import MIXED_CHUNK_EVIDENCE
from kda_spec.config import get_preset

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


def _write(path: Path, events: list[dict], num_slots: int = 2, name: str = "s") -> Path:
    path.write_text(json.dumps({"scenarios": [{"name": name, "num_slots": num_slots, "events": events}]}))
    return path


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"free": "x"}], r"event 1: free 'x', which holds no slot"),
        ([{"alloc": "a"}], r"event 1: request 'a' is allocated twice"),
        ([{"alloc": "b"}, {"alloc": "c"}], r"event 2: alloc 'c' with all 2 slots in use"),
        (
            [{"forward": {"mode": "decode", "requests": [["a", 2]]}}],
            r"event 1: request 'a' has 2 tokens; extend needs >= 1, decode 1",
        ),
        (
            [{"forward": {"mode": "mixed", "requests": [["a", 1]]}}],
            r"event 1: mode must be one of \['extend', 'decode'\], got 'mixed'",
        ),
        ([{"forward": {"mode": "extend", "requests": [["b", 1]]}}], r"event 1: request 'b' holds no slot"),
        (
            [{"forward": {"mode": "extend", "requests": [["a", 1], ["a", 2]]}}],
            r"event 1: a request appears twice in one batch: \['a', 'a'\]",
        ),
        (
            [{"forward": {"mode": "extend", "requests": [["a", 1]], "padding_rows": -1}}],
            r"event 1: padding_rows must be an integer >= 0, got -1",
        ),
        (
            [{"snapshot": "a"}],
            r"event 1: malformed \(ValueError: an event is one key of \['alloc', 'free', 'forward', "
            r"'verify', 'accept', 'copy', 'handoff', 'poison'\], got \{'snapshot': 'a'\}\)",
        ),
        ([{"copy": "a"}], r"event 1: malformed \(ValueError: not enough values to unpack"),
        ([{"forward": {"requests": [["a", 1]]}}], r"event 1: malformed \(KeyError: 'mode'\)"),
    ],
)
def test_a_bad_scenario_is_one_line_naming_the_value(tmp_path, events, message):
    path = _write(tmp_path / "bad.json", [{"alloc": "a"}, *events])
    with pytest.raises(ValueError, match=rf"^--scenarios '.*bad.json': scenario 's', {message}"):
        load_scenarios(path)


# Each precondition, broken by the last event: (events, what `apply` says).
BROKEN_PRECONDITIONS = [
    ([Alloc("a"), Alloc("a")], "request 'a' is allocated twice"),
    ([Alloc("a"), Alloc("b"), Alloc("c")], "alloc 'c' with all 2 slots in use"),
    ([Alloc("a"), Free("a"), Free("a")], "free 'a', which holds no slot"),
    ([Alloc("a"), Forward("mixed", (("a", 1),))], "mode must be one of ['extend', 'decode'], got 'mixed'"),
    ([Alloc("a"), Forward("extend", ())], "a forward needs at least one request"),
    ([Alloc("a"), decode("a", "a")], "a request appears twice in one batch: ['a', 'a']"),
    ([Alloc("a"), extend(("b", 1))], "request 'b' holds no slot (alloc it first)"),
    ([Alloc("a"), extend(("a", 0))], "request 'a' has 0 tokens; extend needs >= 1, decode 1"),
    ([Alloc("a"), Forward("decode", (("a", 2),))], "request 'a' has 2 tokens; extend needs >= 1, decode 1"),
    ([Alloc("a"), extend(("a", 1), padding_rows=-1)], "padding_rows must be an integer >= 0, got -1"),
    ([Alloc("a"), verify(("a", 2))], "a verify of request 'a', which has no prefill yet"),
    ([Alloc("a"), extend(("a", 1)), verify(("a", 0))], "request 'a' has 0 draft tokens; a verify needs >= 1"),
    (
        [Alloc("a"), extend(("a", 1)), verify(("a", 2)), decode("a")],
        "a forward of request 'a', whose verify waits for its accept",
    ),
    (
        [Alloc("a"), extend(("a", 1)), verify(("a", 2)), Free("a")],
        "free 'a', whose verify waits for its accept",
    ),
    ([Alloc("a"), extend(("a", 1)), verify(("a", 2)), Accept("a", 3)], "accept 'a' of 3 draft tokens: 0..2"),
    ([Alloc("a"), Accept("a", 0)], "accept 'a', which has no verify waiting"),
    ([Alloc("a"), Alloc("b"), Copy("a", "b")], "copy from 'a', which has processed no token"),
    (
        [Alloc("a"), extend(("a", 1)), Alloc("b"), extend(("b", 1)), Copy("a", "b")],
        "copy into 'b', which has states already (a new request's slot only)",
    ),
    ([Alloc("a"), extend(("a", 1)), Copy("a", "c")], "copy into 'c', which holds no slot (alloc it first)"),
    (
        [Alloc("a"), Alloc("b"), Handoff(("a",))],
        "a handoff names every request holding a slot once: ['a', 'b'], got ['a']",
    ),
    ([Alloc("a"), Poison("a", "0")], "poison 'a' with '0': one of ['nan', '1e30']"),
    (
        [Alloc("a"), Poison("a", "nan"), extend(("a", 1))],
        "a forward of request 'a', whose slot is poisoned (free it)",
    ),
]


@pytest.mark.parametrize(("events", "message"), BROKEN_PRECONDITIONS)
def test_each_precondition_is_its_events_apply_wherever_the_schedule_comes_from(tmp_path, events, message):
    *before, last = events
    book = ScheduleBook("s", 2).play_all(before)
    unchanged = copy.deepcopy(book)
    with pytest.raises(ValueError) as applied:
        last.apply(book)
    assert str(applied.value) == message and book == unchanged
    expected = f"scenario 's', event {len(before)}: {message}"
    with pytest.raises(ValueError) as built:
        Scenario("s", 2, tuple(events))
    path = _write(tmp_path / "bad.json", [event.as_dict() for event in events])
    with pytest.raises(ValueError) as loaded:
        load_scenarios(path)
    assert str(built.value) == expected
    assert str(loaded.value) == f"--scenarios {str(path)!r}: {expected}"


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (("step", 4, False, -1, False), "padding_rows must be an integer >= 0, got -1"),
        (("step", 0, False, 0, False), "request 'q0' has 0 tokens; extend needs >= 1, decode 1"),
    ],
)
def test_an_impossible_searched_schedule_fails_as_the_same_malformed_file_fails(tmp_path, action, message):
    with pytest.raises(ValueError) as searched:
        schedule(2, [("arrive", [3]), action])
    chunk, padding = action[1], action[3]
    forward = {"forward": {"mode": "extend", "requests": [["q0", chunk]], "padding_rows": padding}}
    path = _write(tmp_path / "bad.json", [{"alloc": "q0"}, forward], name="searched")
    with pytest.raises(ValueError) as loaded:
        load_scenarios(path)
    assert str(searched.value) == f"scenario 'searched', event 1: {message}"
    assert str(loaded.value) == f"--scenarios {str(path)!r}: {searched.value}"


def test_every_event_type_reads_back_its_file_form_and_has_a_runner_action():
    examples: list[Event] = [
        Alloc("a"),
        Free("a"),
        extend(("a", 3), ("b", 1), padding_rows=2),
        verify(("a", 4), ("b", 2), padding_rows=1),
        Accept("a", 2),
        Copy("a", "b"),
        Handoff(("b", "a")),
        Poison("a", "nan"),
    ]
    assert {type(event) for event in examples} == set(EVENT_TYPES.values())
    for event in examples:
        assert EVENT_TYPES[event.key] is type(event)
        assert event_from_dict(json.loads(json.dumps(event.as_dict()))) == event
    actions = ScenarioDriver.__dict__["act"].dispatcher
    assert all(actions.dispatch(kind) is not actions.dispatch(object) for kind in EVENT_TYPES.values())


class RecordingGuard:
    """A stand-in for `GuardedAdapter`: the lowest free slot, zero states, the inputs as outputs; every
    call recorded."""

    def __init__(self, config):
        self.config, self.calls, self.free = config, [], []

    def call(self, method, arguments, validate):
        self.calls.append((method, arguments))
        c, result = self.config, None
        if method == "serving_open":
            self.free = list(range(arguments["num_slots"]))
        elif method == "serving_alloc":
            result = self.free.pop(0)
        elif method == "serving_free":
            self.free.insert(0, arguments["slot"])
        elif method == "serving_state":
            shapes = ((c.num_heads, c.head_dim, c.head_dim), (c.conv_size - 1, 3 * c.proj_dim))
            result = tuple(np.zeros(shape, np.float32) for shape in shapes)
        else:
            result = arguments["hidden_states"]
        return validate(result, method)


def test_the_runner_gives_each_forward_the_tokens_its_requests_processed_before():
    config, stats = get_preset("mini"), HiddenStatistics(0.0, 1.0)
    events = (Alloc("a"), extend(("a", 3)), Alloc("b"), extend(("b", 2), ("a", 1)), Free("a"), Alloc("c"),
              decode("b", padding_rows=1))  # fmt: skip
    scenario = Scenario("s", 2, events)
    guard = RecordingGuard(config)
    inputs = scenario_inputs(scenario, stats, config.hidden_size, "fp32")
    run = ScenarioDriver(guard, scenario, inputs, stats, config, "fp32").run()
    forwards = [arguments for method, arguments in guard.calls if method == "serving_forward"]
    assert [f["prefix_lens"].tolist() for f in forwards] == [[0], [0, 3], [2]]
    assert [f["slots"].tolist() for f in forwards] == [[0], [1, 0], [1]]
    # a's final states when freed, c's outside the decode before and after it, b's and c's at the end
    assert [method for method, _ in guard.calls].count("serving_state") == 5
    assert scenario.request_tokens == {"a": 4, "b": 3, "c": 0}
    assert {name: len(out) for name, out in run.outputs.items()} == scenario.request_tokens


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


class OneTokenSegmentAsNewWithoutVerbs(serving_defects.OneTokenSegmentAsNew):
    """The defect on an adapter that defines none of the optional verbs: the search draws the schedules of
    the serving protocol alone (tests/conformance/test_serving_verbs.py searches with the verbs)."""

    serving_copy = ServingAdapter.serving_copy
    serving_load = ServingAdapter.serving_load
    serving_accept = ServingAdapter.serving_accept


def test_the_serving_search_finds_a_seeded_defect_and_writes_a_replayable_shrunk_schedule(tmp_path):
    assert not set(OPTIONAL_SERVING_CALLS) & provided_calls(OneTokenSegmentAsNewWithoutVerbs)
    code, report = _search(tmp_path, OneTokenSegmentAsNewWithoutVerbs, budget_s=90.0, shrink_budget_s=60.0)
    assert code == 1 and report["found"], report
    (found,) = load_scenarios(tmp_path / "scenarios.json")
    assert len(found.request_tokens) <= 2 and len(found.forwards) <= 3, found  # shrunk
    assert "--scenarios" in report["found"]["replay"]


def test_the_serving_search_finds_nothing_on_kda_impl_within_a_short_budget(tmp_path):
    code, report = _search(tmp_path, KDAImplAdapter, budget_s=10.0)
    assert code == 0 and report["found"] is None and report["schedules_tried"] > 0, report
    assert not (tmp_path / "scenarios.json").exists()
