"""`gate --require-platform` and the policy's `[platform] require`: a report made elsewhere, or whose
Pallas kernels ran in the interpreter, fails (exit 1) naming both; an unknown platform is a usage error.
The report is a real run's (the numpy adapter on one case), its platform block rewritten per test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance.cli import main
from conformance.runtime.run_platform import platform_block
from tests.conformance.policy_files import edited_policy

REPO = Path(__file__).resolve().parents[2]
CPU = {"name": "cpu", "backend": "cpu", "device_kind": "cpu", "device_count": 1, "process_count": 1}
TPU = {"name": "tpu", "backend": "tpu", "device_kind": "TPU v6 lite", "device_count": 8, "process_count": 1}
BASELINE_TABLE = "[baseline]\n"


@pytest.fixture(scope="module")
def passing_report(synthetic_dumps: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """report.json of a passing run: the numpy adapter on T8, fp32."""
    folder = tmp_path_factory.mktemp("platform-run")
    args = ["run", "--dumps", str(synthetic_dumps), "--impl", "tests.conformance.numpy_adapter:NumpyAdapter"]
    args += ["--cases", "T8", "--dtypes", "fp32", "--report-dir", str(folder)]
    done = subprocess.run(
        [sys.executable, "-m", "conformance", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((folder / "report.json").read_text())


def _report_file(
    folder: Path, passing_report: dict[str, Any], kernel_used: str, platform: dict[str, Any]
) -> str:
    """The passing report as if made on `platform` with `kernel_used` in fp32."""
    report = json.loads(json.dumps(passing_report))
    report["environment"]["platform"] = platform_block({"fp32": kernel_used}, platform)
    path = folder / "report.json"
    path.write_text(json.dumps(report))
    return str(path)


def _gate(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    code = main(["gate", *args])
    out, err = capsys.readouterr()
    return code, out + err


def test_a_report_made_on_a_cpu_fails_a_tpu_requirement(tmp_path: Path, capsys, passing_report) -> None:
    report = _report_file(tmp_path, passing_report, "pallas (interpret, cpu)", CPU)
    code, out = _gate(capsys, report, "--require-platform", "tpu")
    assert code == 1 and out.startswith("gate: FAIL (2 breaches; ")
    assert "platform: required tpu, the report was made on cpu, cpu ×1" in out
    assert "the fp32 kernels ran pallas (interpret, cpu): Pallas interpreted, never compiled" in out
    assert _gate(capsys, report)[0] == 0  # nothing required: the numbers hold
    code, out = _gate(capsys, report, "--require-platform", "cpu")
    assert code == 0 and out.startswith("gate: ok (") and out.splitlines()[0].endswith("), made on cpu")


def test_interpreted_pallas_on_a_tpu_fails_and_mosaic_passes(tmp_path: Path, capsys, passing_report) -> None:
    interpreted = _report_file(tmp_path, passing_report, "pallas (interpret, tpu)", TPU)
    code, out = _gate(capsys, interpreted, "--require-platform", "tpu")
    assert code == 1 and "pallas (interpret, tpu): Pallas interpreted" in out
    assert "made on" not in out  # the platform itself is right
    mosaic = _report_file(tmp_path, passing_report, "pallas (mosaic, tpu)", TPU)
    assert _gate(capsys, mosaic, "--require-platform", "tpu")[0] == 0


def test_the_policy_can_require_the_platform(tmp_path: Path, capsys, passing_report) -> None:
    report = _report_file(tmp_path, passing_report, "naive (xla, cpu)", CPU)
    policy = edited_policy(tmp_path, BASELINE_TABLE, '[platform]\nrequire = "tpu"\n\n' + BASELINE_TABLE)
    code, out = _gate(capsys, report, "--tolerances", str(policy))
    assert code == 1 and "platform: required tpu, the report was made on cpu, cpu ×1" in out
    assert _gate(capsys, report, "--tolerances", str(policy), "--require-platform", "cpu")[0] == 0


def test_an_unknown_required_platform_is_a_usage_error(tmp_path: Path, capsys, passing_report) -> None:
    report = _report_file(tmp_path, passing_report, "naive (xla, cpu)", CPU)
    policy = edited_policy(tmp_path, BASELINE_TABLE, '[platform]\nrequire = "gpu"\n\n' + BASELINE_TABLE)
    code, out = _gate(capsys, report, "--tolerances", str(policy))
    assert code == 2
    assert (
        out.strip() == f"error: {policy}: [platform] require must be one of ['cpu', 'tpu', 'cuda'], got 'gpu'"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["gate", report, "--require-platform", "gpu"])
    assert exit_info.value.code == 2
