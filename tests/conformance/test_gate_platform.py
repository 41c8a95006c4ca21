"""`gate --require-platform` and the policy's `[platform] require`: a report made elsewhere, or whose
Pallas kernels ran in the interpreter, fails (exit 1) naming both; an unknown platform is a usage error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance.checks import CheckSpec
from conformance.cli import main
from conformance.metrics import compare
from conformance.report import REPORT_FORMAT, REPORT_VERSION, Record, write_json
from conformance.run_platform import platform_block
from conformance.tolerances import Tolerance
from tests.conformance.policy_files import edited_policy

STRICT, RFC = Tolerance(atol=1e-5, rtol=1e-5), Tolerance(atol=1e-3, rtol=1e-3)
CPU = {"name": "cpu", "backend": "cpu", "device_kind": "cpu", "device_count": 1, "process_count": 1}
TPU = {"name": "tpu", "backend": "tpu", "device_kind": "TPU v6 lite", "device_count": 8, "process_count": 1}
BASELINE_TABLE = "[baseline]\n"


def _report_file(folder: Path, kernel_used: str, platform: dict[str, Any]) -> str:
    """A passing report of one check, made on `platform` with `kernel_used` in fp32."""
    reference = np.linspace(-1, 1, 16).reshape(8, 2)
    comparison = compare(reference, reference, STRICT, RFC, ("token", "channel"))
    check = Record(CheckSpec("T8", "fp32", "layer"), "passed", "", 0.1, comparison).as_dict(0.5)
    report = {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "dumps": {"url": "golden", "manifest_sha256": "a" * 64},
        "environment": {"platform": platform_block({"fp32": kernel_used}, platform)},
        "checks": [check],
    }
    path = folder / "report.json"
    write_json(report, path)
    return str(path)


def _gate(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    code = main(["gate", *args])
    out, err = capsys.readouterr()
    return code, out + err


def test_a_report_made_on_a_cpu_fails_a_tpu_requirement(tmp_path: Path, capsys) -> None:
    report = _report_file(tmp_path, "pallas (interpret, cpu)", CPU)
    code, out = _gate(capsys, report, "--require-platform", "tpu")
    assert code == 1 and out.startswith("gate: FAIL (2 breaches; 1 passed, ")
    assert "platform: required tpu, the report was made on cpu, cpu ×1" in out
    assert "the fp32 kernels ran pallas (interpret, cpu): Pallas interpreted, never compiled" in out
    assert _gate(capsys, report)[0] == 0  # nothing required: the numbers hold
    code, out = _gate(capsys, report, "--require-platform", "cpu")
    assert code == 0 and out.startswith("gate: ok (1 passed, 0 failed, 0 error, 0 skipped), made on cpu")


def test_interpreted_pallas_on_a_tpu_fails_and_mosaic_passes(tmp_path: Path, capsys) -> None:
    interpreted = _report_file(tmp_path, "pallas (interpret, tpu)", TPU)
    code, out = _gate(capsys, interpreted, "--require-platform", "tpu")
    assert code == 1 and "pallas (interpret, tpu): Pallas interpreted" in out
    assert "made on" not in out  # the platform itself is right
    assert (
        _gate(capsys, _report_file(tmp_path, "pallas (mosaic, tpu)", TPU), "--require-platform", "tpu")[0]
        == 0
    )


def test_the_policy_can_require_the_platform(tmp_path: Path, capsys) -> None:
    report = _report_file(tmp_path, "naive (xla, cpu)", CPU)
    policy = edited_policy(tmp_path, BASELINE_TABLE, '[platform]\nrequire = "tpu"\n\n' + BASELINE_TABLE)
    code, out = _gate(capsys, report, "--tolerances", str(policy))
    assert code == 1 and "platform: required tpu, the report was made on cpu, cpu ×1" in out
    assert _gate(capsys, report, "--tolerances", str(policy), "--require-platform", "cpu")[0] == 0


def test_an_unknown_required_platform_is_a_usage_error(tmp_path: Path, capsys) -> None:
    report = _report_file(tmp_path, "naive (xla, cpu)", CPU)
    policy = edited_policy(tmp_path, BASELINE_TABLE, '[platform]\nrequire = "gpu"\n\n' + BASELINE_TABLE)
    code, out = _gate(capsys, report, "--tolerances", str(policy))
    assert code == 2
    assert (
        out.strip() == f"error: {policy}: [platform] require must be one of ['cpu', 'tpu', 'cuda'], got 'gpu'"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["gate", report, "--require-platform", "gpu"])
    assert exit_info.value.code == 2
