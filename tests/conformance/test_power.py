"""`python -m conformance power`: injected defects, the ε search, the reports and the exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance import cli
from conformance.adapters.defects import Injection
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.tools import power, power_report
from conformance.tools.power import GRID, POLICIES, Outcome, PowerMeter, smallest_caught
from tests.conformance.synthetic import write_dump_set


@pytest.fixture(scope="module")
def truth_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dump_set(tmp_path_factory.mktemp("power"), ("T8", "varlen_initstate"), truth=True)


@pytest.fixture(scope="module")
def meter(truth_dumps: Path) -> PowerMeter:
    return PowerMeter(DumpSet(str(truth_dumps)), TolerancePolicy.load(), "auto")


def _defect(defect_id: str, dumps: DumpSet) -> power.Defect:
    (defect,) = power.select_defects(power.defects(list(dumps.weights())), [defect_id])
    return defect


def _plan(defect: power.Defect, dumps: DumpSet) -> dict[str, list[str]]:
    return {
        c: power.checks_for(defect, dumps.cases[c].seq_lens) for c in power.cases_for(defect, dumps, None)
    }


def test_no_defect_and_zero_eps_catch_nothing(meter: PowerMeter) -> None:
    dumps = meter.dumps
    for defect_id in ("scale:q_proj.weight", "leak:state"):
        defect = _defect(defect_id, dumps)
        plan = _plan(defect, dumps)
        assert list(plan) == {"scale:q_proj.weight": ["T8"], "leak:state": ["varlen_initstate"]}[defect_id]
        for injection in (Injection(), defect.inject(dumps.weights(), 0.0)):
            outcome = meter.evaluate("fp32", injection, plan)
            assert outcome.failed == {policy: [] for policy in POLICIES}, (defect_id, outcome.failed)


def test_structural_defect_is_caught_and_switched_off_again(meter: PowerMeter) -> None:
    dumps = meter.dumps
    defect = _defect("drop:decode-conv", dumps)
    plan = _plan(defect, dumps)
    assert list(plan) == ["varlen_initstate"]  # of its preferred cases (T65, varlen_initstate)
    assert all(check.startswith("decode-") for checks in plan.values() for check in checks)
    broken = meter.evaluate("fp32", defect.inject(dumps.weights(), 1.0), plan)
    assert all(broken.caught(policy) for policy in POLICIES), broken.failed
    assert broken.caught_by("default").endswith(":decode-k1")
    healed = meter.evaluate("fp32", Injection(), plan)  # the same adapter, the defect switched off
    assert not any(healed.caught(policy) for policy in POLICIES), healed.failed
    # A check the unmodified implementation already fails catches nothing.
    meter.baseline["fp32"] = broken
    try:
        masked = meter.evaluate("fp32", defect.inject(dumps.weights(), 1.0), plan)
    finally:
        del meter.baseline["fp32"]
    assert masked.failed == {policy: [] for policy in POLICIES}


def test_weight_scale_is_caught_at_a_small_eps(meter: PowerMeter) -> None:
    dumps = meter.dumps
    defect = _defect("scale:o_proj.weight", dumps)
    outcome = meter.evaluate("fp32", defect.inject(dumps.weights(), 1e-3), _plan(defect, dumps))
    assert outcome.caught("default") and outcome.caught("absolute"), outcome.failed


def _threshold(eps_caught: float, policy_thresholds: dict[str, float]) -> Outcome:
    return Outcome({p: ([f"x:{p}"] if eps_caught >= t else []) for p, t in policy_thresholds.items()})


def test_search_brackets_the_threshold_within_a_third() -> None:
    thresholds = {"default": 3e-6, "absolute": 4.2e-2}
    evaluated: list[float] = []

    def evaluate(eps: float) -> Outcome:
        evaluated.append(eps)
        return _threshold(eps, thresholds)

    found, points = smallest_caught(evaluate)
    for policy, threshold in thresholds.items():
        assert threshold <= found[policy]["eps"] <= 1.34 * threshold, (policy, found[policy])
        assert found[policy]["below"] < threshold
        assert found[policy]["caught_by"] == f"x:{policy}"
    assert len(evaluated) == len(set(evaluated)) == len(points)  # no point evaluated twice
    assert len(evaluated) <= len(GRID) + 2 * power.BISECT_STEPS


def test_search_reports_what_is_never_caught_or_always_caught() -> None:
    found, _ = smallest_caught(lambda eps: _threshold(eps, {"default": 0.0, "absolute": 1.0}))
    assert found["default"] == {"eps": GRID[0], "below": None, "caught_by": "x:default"}
    assert found["absolute"]["eps"] is None and found["absolute"]["below"] == GRID[-1]


def test_cli_exit_0_and_reports(truth_dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["power", "--dumps", str(truth_dumps), "--dtype", "fp32", "--defects", "drop:*"]
    code = cli.main([*argv, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "drop:decode-conv" in out and "goals met" in out
    result = json.loads((tmp_path / "power.json").read_text())
    (row,) = result["rows"]
    assert row["default"]["caught"] and row["absolute"]["caught"] and row["met"]
    assert result["baseline"]["fp32"]["failed"] == {"default": [], "absolute": []}
    assert "| drop:decode-conv" in (tmp_path / "power.md").read_text()


def test_cli_exit_1_names_the_defect_missed(truth_dumps: Path, tmp_path: Path, capsys) -> None:
    argv = ["power", "--dumps", str(truth_dumps), "--dtype", "fp32", "--defects", "leak:*", "--cases", "T8"]
    code = cli.main([*argv, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "leak:state (fp32): not measured, no case of the run exercises it" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dumps", "/nonexistent/dumps"], "/nonexistent/dumps"),
        (["--cases", "T9999"], "T9999"),
        (["--defects", "scale:no_such_weight"], "scale:no_such_weight"),
    ],
)
def test_cli_exit_2_on_bad_input(truth_dumps: Path, tmp_path: Path, capsys, extra, message) -> None:
    argv = ["power", "--dumps", str(truth_dumps), "--report-dir", str(tmp_path), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "power.json").exists()


def test_the_comparison_names_how_close_to_its_limit_an_earlier_absolute_catch_already_was() -> None:
    def row(defect: str, default: float, absolute: float, caught_by: str) -> dict:
        return {
            "defect": defect,
            "dtype": "bf16",
            "measured": True,
            "structural": False,
            "default": {"eps": default, "below": None, "caught_by": "T65:layer"},
            "absolute": {"eps": absolute, "below": None, "caught_by": caught_by},
        }

    result = {
        "baseline": {"bf16": {"ratios": {"absolute": {"T65:decode-k8": 0.963}, "default": {}}}},
        "rows": [row("scale:a", 1e-4, 2e-6, "T65:decode-k8"), row("scale:b", 1e-5, 1e-3, "T65:g")],
    }
    assert power_report.comparison_line(result) == (
        "default policy at least as powerful as the absolute gate in 1 of 2 rows; weaker in: "
        "scale:a (bf16) [T65:decode-k8 at 0.96 of its limit without it]"
    )


def test_the_baseline_records_every_compared_check_ratio(meter: PowerMeter) -> None:
    outcome = meter.evaluate("fp32", Injection(), {"T8": ["layer", "g"]})
    assert set(outcome.ratios["absolute"]) == set(outcome.ratios["default"]) == {"T8:layer", "T8:g"}
    assert all(0 <= r < 1 for ratios in outcome.ratios.values() for r in ratios.values())
