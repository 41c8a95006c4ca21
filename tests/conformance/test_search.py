"""`conformance search` (docs/search.md): the space, the reproducer set, the judge on a correct
implementation, and a short search for each seeded defect (tests/conformance/seeded_adapters.py).

The short searches draw from a narrowed space (fp32, one or two short sequences, the stress weights)
on the tiny config, so that each finds its defect within its first cases; the command itself searches
the full space (docs/search.md has the times of `make bench`'s full searches)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis.internal.conjecture import engine

from conformance import cli
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks.serving_scenarios import Scenario, scenario_from_dict
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.search import reproducer
from conformance.search.dumpcase import CASE_ID
from conformance.search.explore import explore
from conformance.search.judge import HEADROOM, CaseVerdict, CheckJudgement, Judge
from conformance.search.serving_space import schedule_strategy
from conformance.search.space import SearchCase, case_inputs, case_strategy, steered
from conformance.search.weight_sets import WeightSet, weight_sets
from kda_spec.synthetic_weights import stress_weights, synthetic_weights
from kda_spec.truth import sigmoid, softplus
from tests.conformance import seeded_adapters
from tests.conformance.synthetic import TINY

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@settings(max_examples=50, deadline=None)
@given(case_strategy(("fp32", "bf16"), ("a", "b"), max_tokens=100, max_seqs=3))
def test_generated_cases_fit_the_limits(case: SearchCase) -> None:
    assert 1 <= len(case.seq_lens) <= 3 and 1 <= case.tokens <= 100 and min(case.seq_lens) >= 1


@settings(max_examples=50, deadline=None)
@given(schedule_strategy(max_tokens=16))
def test_every_drawn_schedule_reads_back_from_its_file_form(scenario: Scenario) -> None:
    assert scenario_from_dict(json.loads(json.dumps(scenario.as_dict()))) == scenario
    book = scenario.book()
    assert book.events == list(scenario.events) and book.processed == scenario.request_tokens


def test_steered_inputs_reach_their_regimes() -> None:
    weights = synthetic_weights(TINY, 0)
    x = np.random.default_rng(0).standard_normal((5, TINY.hidden_size))
    moved = steered(x, weights, TINY, gate_target=None, beta_target=10.0)
    assert np.all(sigmoid(moved @ weights["b_proj.weight"].T) > 0.9999)
    moved = steered(x, weights, TINY, gate_target=8.0, beta_target=None)
    f = moved @ weights["f_a_proj.weight"].T @ weights["f_b_proj.weight"].T + weights["dt_bias"]
    assert (
        softplus(f).mean()
        > 4 * softplus(x @ weights["f_a_proj.weight"].T @ weights["f_b_proj.weight"].T).mean()
    )


@pytest.fixture(scope="module")
def tiny_judge_parts() -> tuple[TolerancePolicy, dict]:
    weights = synthetic_weights(TINY, 0)
    stressed = {**weights, **{k: stress_weights(TINY, 0)[k] for k in ("A_log", "dt_bias")}}
    sets = {"synthetic": WeightSet(TINY, weights, "s"), "stress": WeightSet(TINY, stressed, "t")}
    return TolerancePolicy.load(), sets


def _judge(adapter_class, parts) -> Judge:
    policy, sets = parts
    return Judge(adapter_class, "auto", {}, policy, sets)


def test_the_case_set_is_a_verified_dump_set_holding_its_inputs(tmp_path, tiny_judge_parts) -> None:
    case = SearchCase("bf16", "stress", (5, 33), init="large", gate="strong", seed=3)
    judge = _judge(KDAImplAdapter, tiny_judge_parts)
    judge.write(case, str(tmp_path / "set"), {"check": "layer"})
    dumps = DumpSet(str(tmp_path / "set"))
    assert (
        dumps.verify() == [] and "truth" in dumps.manifest and dumps.manifest["search"]["case"]["seed"] == 3
    )
    data = dumps.case(CASE_ID)
    inputs = case_inputs(case, tiny_judge_parts[1]["stress"].weights, TINY)
    np.testing.assert_array_equal(data.hidden_states, inputs.hidden_states)
    np.testing.assert_array_equal(data.initial_state, inputs.initial_state)
    assert data.has_dtype("bf16") and not data.has_dtype("fp32")


def test_kda_impl_is_not_flagged_on_hard_cases(tiny_judge_parts) -> None:
    judge = _judge(KDAImplAdapter, tiny_judge_parts)
    for case in (
        SearchCase("fp32", "stress", (97,), scale_exp=2, seed=1090),
        SearchCase("fp32", "synthetic", (64, 1), init="large", scale_exp=-4, beta="near1"),
        SearchCase("bf16", "stress", (33, 40), init="small", gate="strong", beta="near0"),
    ):
        verdict = judge.judge(case)
        assert not verdict.flagged, [j.as_dict() for j in verdict.flagged]
        assert len(verdict.checks) >= 15


SHORT = case_strategy(("fp32",), ("stress",), max_tokens=128, max_seqs=2)


@pytest.mark.parametrize(
    ("adapter", "checks"),
    [
        (
            seeded_adapters.TransposedInitialState,
            {"layer", "layer-state", "kernel-chunk", "kernel-recurrent"},
        ),
        (
            seeded_adapters.StateDroppedAtChunkBoundary,
            {"layer-state", "kernel-chunk-state", "chunked-prefill"},
        ),
        (seeded_adapters.ConvOffByOneAfterSplit, {"chunked-prefill", "chunked-prefill-state"}),
        (seeded_adapters.RunningSumDecay, None),
    ],
)
def test_a_short_search_finds_each_seeded_defect(adapter, checks, tiny_judge_parts) -> None:
    judge = _judge(adapter, tiny_judge_parts)
    exploration = explore(judge.judge, SHORT, budget_s=240, seed=0, shrink_budget_s=5)
    finding = exploration.finding
    assert finding is not None, f"{adapter.name}: nothing found in {exploration.cases} cases"
    assert checks is None or finding.check in checks or finding.check.startswith(tuple(checks))
    assert finding.verdict.checks[finding.check].ratio > HEADROOM


def test_the_shrink_budget_lifts_hypothesis_own_cap_on_a_shrink() -> None:
    caps: list[float] = []

    def judge(case: SearchCase) -> CaseVerdict:
        caps.append(engine.MAX_SHRINKING_SECONDS)
        ratio = 10.0 if case.tokens >= 10 else 0.0
        return CaseVerdict(case, {"layer": CheckJudgement("layer", ratio, ratio, ratio, 1, 1)}, {}, 0.0, TINY)

    default = engine.MAX_SHRINKING_SECONDS
    cases = case_strategy(("fp32",), ("a",), max_tokens=100, max_seqs=3)
    finding = explore(judge, cases, budget_s=60, seed=0, shrink_budget_s=default + 900).finding
    assert finding is not None and finding.case.seq_lens == (10,)
    restored = engine.MAX_SHRINKING_SECONDS
    assert set(caps) == {default + 900} and restored == default


def test_the_command_finds_writes_and_replays_a_reproducer(tmp_path) -> None:
    code = cli.main(
        [
            "search", "--impl", "tests.conformance.seeded_adapters:TransposedInitialState",
            "--preset", "mini", "--budget", "120", "--shrink-budget", "10", "--max-tokens", "64",
            "--max-seqs", "2", "--out", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 1
    report = json.loads((tmp_path / "search.json").read_text())
    finding = report["finding"]
    assert [r["passed"] for r in finding["replay"]] == [False]
    assert finding["replay"][0]["verdict"] == "impl"
    assert finding["kda_impl_fails"] == []
    assert finding["replay_command"].startswith("python -m conformance run --dumps")
    assert DumpSet(str(tmp_path / reproducer.REPRODUCER_DIR)).verify() == []


def test_a_clean_search_exits_0_and_reports_every_check(tmp_path) -> None:
    code = cli.main(
        [
            "search",
            "--preset",
            "mini",
            "--budget",
            "5",
            "--max-tokens",
            "40",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "search.json").read_text())
    assert report["finding"] is None and report["tally"]["cases"] >= 1
    assert set(report["tally"]["per_check"]) >= {"layer", "decode-k1", "chunked-prefill-state"}


def test_bad_arguments_are_usage_errors(tmp_path, capsys) -> None:
    assert cli.main(["search", "--budget", "0", "--out", str(tmp_path)]) == 2
    assert "--budget must be positive" in capsys.readouterr().err
    assert cli.main(["search", "--dtypes", "fp16", "--out", str(tmp_path)]) == 2


def test_weight_sets_of_a_preset_have_a_stress_set() -> None:
    sets = weight_sets(None, "mini", 0)
    assert set(sets) == {"synthetic", "stress"} and sets["stress"].config.hidden_size == 128
    assert np.exp(sets["stress"].weights["A_log"]).max() == pytest.approx(16.0)
    assert sets["stress"].source.startswith("synthetic:mini@0")


def test_weight_sets_span_every_family_the_implementation_serves() -> None:
    sets = weight_sets(None, "mini", 0, {"kimi-linear", "glm5-next"})
    glm_sets = [f"glm5-next{bound}/{kind}" for bound in ("", "@L-3") for kind in ("synthetic", "stress")]
    assert list(sets) == ["synthetic", "stress", *glm_sets]
    assert sets["glm5-next@L-3/synthetic"].config.gate_lower_bound == -3.0
    glm = sets["glm5-next/stress"]
    assert glm.config.family == "glm5-next" and glm.config.gate_lower_bound == -5.0
    assert glm.config.hidden_size == 128 and "forget_gate.A_log" in glm.weights
    # The stress twin holds the lower-bound gate at its floor in every 4th channel.
    dt_bias = glm.weights["forget_gate.dt_bias"].reshape(2, 64)
    assert dt_bias[:, ::4].min() >= 2.0


def test_max_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens and max_seqs must be >= 1, got 0"):
        case_strategy(("fp32",), ("a",), max_tokens=0)


def test_strategy_values_shrink_to_the_simplest_case() -> None:
    case = find(case_strategy(("fp32",), ("a",)), lambda c: True)
    assert case == SearchCase("fp32", "a", (1,))
