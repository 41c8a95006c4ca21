"""The gate says no where it must: missing checks, other dump sets, bad factors and limits, tampered
or malformed reports. Reports here are built from real comparisons, without running the suite."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance.checks.catalogue import CheckSpec
from conformance.cli import main
from conformance.judging.limits import Tolerance
from conformance.policy import DEFAULT_POLICY_FILE, TolerancePolicy
from conformance.reports.check_record import summary
from conformance.reports.json_file import write_json
from conformance.reports.report import Record
from tests.conformance.absolute import compare
from tests.conformance.report_files import criterion
from tests.conformance.report_files import report_of as _report

CASES = ("T1", "T8", "T65")
STRICT, RFC = Tolerance(atol=1e-5, rtol=1e-5), Tolerance(atol=1e-3, rtol=1e-3)


def _check(case: str, check: str = "layer", error: float = 1e-6) -> dict[str, Any]:
    """One check as the suite records it, from a real comparison of a result `error` off."""
    reference = np.linspace(-1, 1, 16).reshape(8, 2)
    comparison = compare(reference + error, reference, STRICT, RFC, ("token", "channel"))
    status = "passed" if comparison.passed else "failed"
    return Record(CheckSpec(case, "fp32", check), status, summary(comparison), 0.1, comparison).as_dict(0.5)


def _write(path: Path, report: dict[str, Any]) -> str:
    write_json(report, path)
    return str(path)


def _full() -> list[dict[str, Any]]:
    return [_check(case, check) for case in CASES for check in ("layer", "kernel-chunk")]


def _gate(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["gate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_an_honest_report_passes_alone_and_against_itself(tmp_path: Path, capsys) -> None:
    report = _write(tmp_path / "r.json", _report(_full()))
    assert _gate(capsys, report)[0] == 0
    code, out, _ = _gate(capsys, report, "--baseline", report)
    assert code == 0 and out.startswith("gate: ok (6 passed, 0 failed, 0 error, 0 skipped) against baseline")


@pytest.mark.parametrize(
    ("completion", "said"),
    [
        (
            {"complete": False, "planned": 6, "ran": 6, "stopped": "interrupted by SIGINT"},
            "interrupted by SIGINT",
        ),
        ({"complete": True, "planned": 7, "ran": 6, "stopped": None}, "6 of 7 planned checks ran"),
        (
            {"complete": True, "planned": 6, "ran": 6, "stopped": "stopped at the first failing check (-x)"},
            "(-x)",
        ),
    ],
    ids=["interrupted", "fewer checks than planned", "stopped by -x"],
)
def test_an_incomplete_report_is_refused_with_or_without_a_baseline(
    tmp_path: Path, capsys, completion: dict[str, Any], said: str
) -> None:
    """Its own word that it is complete does not count: the checks are counted against the plan."""
    baseline = _write(tmp_path / "old.json", _report(_full()))
    report = _write(tmp_path / "new.json", _report(_full()) | {"completion": completion})
    for extra in ([], ["--baseline", baseline]):
        code, _, err = _gate(capsys, report, *extra)
        assert code == 2 and "the run is incomplete" in _one_error_line(err) and said in err


def test_a_check_missing_from_the_new_report_is_a_breach(tmp_path: Path, capsys) -> None:
    baseline = _write(tmp_path / "old.json", _report(_full()))
    report = _write(tmp_path / "new.json", _report(_full()[:1]))
    code, out, _ = _gate(capsys, report, "--baseline", baseline)
    assert code == 1
    assert "gate: FAIL (5 breaches; 1 passed, 0 failed, 0 error, 0 skipped)" in out
    assert "  T65-fp32-kernel-chunk: in the baseline (passed), missing from this report" in out


def test_reports_on_different_dump_sets_are_refused_unless_allowed(tmp_path: Path, capsys) -> None:
    baseline = _write(tmp_path / "old.json", _report(_full(), digest="b" * 64))
    report = _write(tmp_path / "new.json", _report(_full()))
    code, _, err = _gate(capsys, report, "--baseline", baseline)
    assert code == 2
    assert "made on another dump set than the baseline (manifest sha256 aaaaaaaaaaaa… against bbbb" in (
        _one_error_line(err)
    )
    assert _gate(capsys, report, "--baseline", baseline, "--allow-different-dumps")[0] == 0


def test_a_baseline_without_a_dump_digest_is_refused_unless_allowed(tmp_path: Path, capsys) -> None:
    baseline = _write(tmp_path / "old.json", _report(_full(), digest=None))
    report = _write(tmp_path / "new.json", _report(_full()))
    code, _, err = _gate(capsys, report, "--baseline", baseline)
    assert code == 2 and "the baseline records no dump-set digest" in _one_error_line(err)
    assert _gate(capsys, report, "--baseline", baseline, "--allow-different-dumps")[0] == 0


@pytest.mark.parametrize("factor", ["nan", "inf", "-inf", "0", "-1", "1"])
def test_growth_factor_must_be_finite_and_above_one(tmp_path: Path, capsys, factor: str) -> None:
    report = _write(tmp_path / "r.json", _report(_full()))
    code, _, err = _gate(capsys, report, "--baseline", report, f"--growth-factor={factor}")
    assert code == 2
    assert _one_error_line(err).startswith("error: --growth-factor must be a finite number > 1, got ")


def _policy_with(table: str, key: str, value: str) -> str:
    """The default policy file's text with `key` of `[table]` set to `value`."""
    text = DEFAULT_POLICY_FILE.read_text()
    line = re.compile(rf"^{key} = .*$", re.MULTILINE).search(text, text.index(f"{table}\n"))
    return text[: line.start()] + f"{key} = {value}" + text[line.end() :]


@pytest.mark.parametrize(
    ("table", "key", "value", "named"),
    [
        ("[gate.fp32]", "atol", "inf", "[gate.fp32]: tolerance atol must be a finite number >= 0, got inf"),
        ("[gate.bf16]", "rtol", "-1", "[gate.bf16]: tolerance rtol must be a finite number >= 0, got -1"),
        ("[gate.bf16]", "max_nrmse", "nan", "[gate.bf16]: tolerance max_nrmse must be a finite number >= 0"),
        (
            "[baseline]",
            "growth_factor",
            "inf",
            "[baseline] growth_factor must be a finite number > 1, got inf",
        ),
        ("[baseline]", "min_ratio", "nan", "[baseline] min_ratio must be a finite number >= 0, got nan"),
    ],
)
def test_a_policy_with_non_finite_or_negative_limits_is_refused(
    tmp_path: Path, capsys, table: str, key: str, value: str, named: str
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(_policy_with(table, key, value))
    with pytest.raises(ValueError, match=re.escape(f"{policy}: {named}")):
        TolerancePolicy.load(policy)
    report = _write(tmp_path / "r.json", _report(_full()))
    code, _, err = _gate(capsys, report, "--tolerances", str(policy))
    assert code == 2 and named in _one_error_line(err)


def test_an_override_with_an_infinite_limit_is_refused(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        DEFAULT_POLICY_FILE.read_text()
        + '\n[[override]]\ncheck = "layer"\ndtype = "fp32"\natol = inf\nreason = "x"\n'
    )
    with pytest.raises(
        ValueError, match=r"\('layer'\): tolerance atol must be a finite number >= 0, got inf"
    ):
        TolerancePolicy.load(policy)


NRMSE_CRITERION = {
    "gate": "absolute", "statistic": "normalised RMSE", "value": 0.5, "factor": 0, "reference": 0,
    "floor": 0.1, "tokens": 64, "min_tokens": 32,
}  # fmt: skip
TAMPERINGS = {
    "margin above 1": (lambda check: criterion(check, "margin").update(value=50.0), "margin 50 > 1"),
    "margin NaN": (lambda check: criterion(check, "margin").update(value="nan"), "margin nan > 1"),
    "NaN in the result": (
        lambda check: criterion(check, "NaN/Inf values in the result").update(value=2),
        "NaN/Inf values in the result 2 > 0",
    ),
    "nRMSE over its limit": (
        lambda check: check["metrics"]["criteria"].append(NRMSE_CRITERION),
        "normalised RMSE 0.5 > 0.1",
    ),
    "recorded failures": (
        lambda check: check["metrics"].update(failures=["12 of 16 elements outside"]),
        "recorded failures",
    ),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_a_passed_status_whose_numbers_fail_is_a_breach(tmp_path: Path, capsys, name: str) -> None:
    edit, reason = TAMPERINGS[name]
    checks = _full()
    edit(checks[2])
    report = _write(tmp_path / "r.json", _report(checks))
    code, out, _ = _gate(capsys, report)
    assert code == 1
    assert f"  T8-fp32-layer: recorded as passed, but its numbers fail: {reason}" in out


def test_growth_is_judged_on_the_recomputed_ratio_not_the_recorded_one(tmp_path: Path, capsys) -> None:
    baseline, checks = _full(), _full()
    criterion(baseline[0], "margin").update(value=0.01)
    criterion(checks[0], "margin").update(value=0.5)
    checks[0]["metrics"].update(gate_ratio=0.01)  # a ratio that hides the growth
    old = _write(tmp_path / "old.json", _report(baseline))
    code, out, _ = _gate(capsys, _write(tmp_path / "new.json", _report(checks)), "--baseline", old)
    assert code == 1 and "T1-fp32-layer: error grew over the baseline: ratio to the limit 0.01 → 0.5" in out


MALFORMED = {
    "a check that is a number": (lambda checks: checks.__setitem__(0, 5), "checks[0]: expected an object"),
    "an id that is a number": (lambda checks: checks[0].update(id=1), "checks[0]: 'id' must be a string"),
    "no status": (lambda checks: checks[0].pop("status"), "checks[0]: 'status' must be a string"),
    "an unknown status": (lambda checks: checks[0].update(status="great"), "'status' must be one of"),
    "metrics a string": (lambda checks: checks[0].update(metrics="x"), "'metrics' must be an object or null"),
    "a pass without metrics": (lambda checks: checks[0].update(metrics=None), "must record its 'metrics'"),
    "a margin that is text": (
        lambda checks: criterion(checks[0], "margin").update(value="low"),
        "criterion 'value' must be a number",
    ),
    "an infinite bound": (
        lambda checks: criterion(checks[0], "margin").update(floor="inf"),
        "floor must be a finite number >= 0",
    ),
    "a bound of 0": (lambda checks: criterion(checks[0], "margin").update(floor=0), "not > 0"),
    "no criteria": (lambda checks: checks[0]["metrics"].pop("criteria"), "'criteria' must be a list"),
    "a criterion that is a number": (
        lambda checks: checks[0]["metrics"]["criteria"].__setitem__(0, 5),
        "a criterion must be an object",
    ),
    "the absolute gate left out": (
        lambda checks: checks[0]["metrics"].update(criteria=checks[0]["metrics"]["criteria"][:1]),
        "has none of the ['absolute'] gate(s) it measured",
    ),
    "an unknown mode": (lambda checks: checks[0]["metrics"].update(mode="lenient"), "'mode' must be one of"),
    "a duplicated id": (
        lambda checks: checks.append(dict(checks[0])),
        "check id 'T1-fp32-layer' appears twice",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_report_is_one_line_and_exit_2(tmp_path: Path, capsys, name: str) -> None:
    edit, message = MALFORMED[name]
    checks = _full()
    edit(checks)
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report(checks)))
    code, _, err = _gate(capsys, str(report))
    assert code == 2 and message in _one_error_line(err)
    code, _, err = _gate(capsys, _write(tmp_path / "good.json", _report(_full())), "--baseline", str(report))
    assert code == 2 and message in _one_error_line(err)
