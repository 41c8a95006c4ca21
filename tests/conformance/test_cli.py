"""The commands end to end: run writes the reports, gate and diff judge them, exit codes tell CI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli import main
from tests.conformance.report_files import criterion

REPO = Path(__file__).resolve().parents[2]
NUMPY_IMPL = "tests.conformance.numpy_adapter:NumpyAdapter"
CASES = ["T8", "varlen_initstate"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def good_run(synthetic_dumps: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    reports = tmp_path_factory.mktemp("good")
    result = _run(
        "run",
        "--dumps",
        str(synthetic_dumps),
        "--impl",
        NUMPY_IMPL,
        "--cases",
        *CASES,
        "--report-dir",
        str(reports),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return reports, result.stdout


def test_run_writes_the_three_reports(good_run: tuple[Path, str]) -> None:
    reports, stdout = good_run
    report = json.loads((reports / "report.json").read_text())
    assert report["summary"]["failed"] == 0 and report["summary"]["passed"] > 50
    assert report["implementation"]["name"] == "numpy-reference"
    assert report["dumps"]["manifest"]["format"] == "kda-dump"
    assert report["environment"]["versions"]["jax"]
    check = next(c for c in report["checks"] if c["id"] == "varlen_initstate-bf16-layer")
    assert set(check["metrics"]) >= {
        "max_abs",
        "max_rel",
        "n_outside",
        "share_outside",
        "margin",
        "nrmse",
        "worst",
        "rfc",
    }
    assert re.search(r"^\| varlen_initstate +\| bf16 +\|", (reports / "report.md").read_text(), re.M)
    junit = (reports / "junit.xml").read_text()
    assert 'name="test_check[T8-fp32-decode-k1]"' in junit
    assert "KDA conformance" in stdout and "decode" in stdout
    assert main(["gate", str(reports / "report.json")]) == 0


def test_the_reports_say_first_where_the_run_ran(good_run: tuple[Path, str]) -> None:
    reports, stdout = good_run
    platform = json.loads((reports / "report.json").read_text())["environment"]["platform"]
    assert set(platform) >= {
        "name",
        "backend",
        "device_kind",
        "device_count",
        "kernels",
        "pallas_interpreted",
    }
    assert platform["kernels"] == {"fp32": "auto", "bf16": "auto"}  # the numpy adapter's kernel_used
    first = f"platform: {platform['name']}, {platform['device_kind']} ×{platform['device_count']}"
    dumps = json.loads((reports / "report.json").read_text())["dumps"]
    assert dumps["bundled"] is False
    assert dumps["label"] == f"{dumps['url']} (manifest sha256 {dumps['manifest_sha256']})"
    # The verdict line first, then which dump set ran, where the run ran and how its kernels ran.
    summary = [line for line in stdout[stdout.index("KDA conformance") :].splitlines() if line]
    # 16 + 4 + 28 + 72: the numpy adapter has no raw-gate form, no checkpoints, no kernel or layer gradients
    assert summary[1].startswith("PASS: 92 checked, 124 skipped")
    assert dumps["family"] == "kimi-linear"
    assert summary[2] == f"dumps: {dumps['label']}, family kimi-linear"
    assert summary[3].startswith(first) and summary[4] == "kernels: auto (fp32, bf16)"
    markdown = (reports / "report.md").read_text().splitlines()
    assert markdown[2].startswith("**PASS**: 92 checked")
    assert markdown[4] == f"- dumps: {dumps['label']}, family kimi-linear"
    assert markdown[5].startswith(f"- {first}") and markdown[6] == "- kernels: auto (fp32, bf16)"


def test_kda_conform_finds_an_adapter_in_the_current_folder(tmp_path: Path, synthetic_dumps: Path) -> None:
    """As a console script runs it: `python -P`, the cwd not on sys.path; the module is found there."""
    (tmp_path / "my_adapter.py").write_text("class Mine:\n    pass\n")
    script = "import sys; from conformance.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            "-c",
            script,
            "run",
            "--dumps",
            str(synthetic_dumps),
            "--impl",
            "my_adapter:Mine",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "'Mine' is not a subclass of conformance.adapter.KDAAdapter" in result.stderr, result.stderr


def test_broken_implementation_fails_run_and_gate(
    synthetic_dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    result = _run(
        "run",
        "--dumps",
        str(synthetic_dumps),
        "--impl",
        "tests.conformance.broken_adapters:NumpyFlippedGate",
        "--cases",
        "T8",
        "--dtypes",
        "fp32",
        "--report-dir",
        str(tmp_path),
    )
    assert result.returncode == 1
    assert re.search(r"^FAILED (2 checks \()?T8-fp32-layer[,:]", result.stdout, re.M), result.stdout
    assert main(["gate", str(tmp_path / "report.json")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("gate: FAIL")
    assert "T8-fp32-layer: failed: " in out and "T8-fp32-kernel-chunk" not in out


def test_gate_fails_where_an_error_grew_over_the_baseline(
    good_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    report = json.loads((good_run[0] / "report.json").read_text())
    baseline = json.loads(json.dumps(report))
    check = next(c for c in report["checks"] if c["id"] == "T8-fp32-decode-k8")
    # The gate recomputes the ratio to the limit from the recorded criteria; with no truth recorded, from
    # the absolute ones alone (here: the margin).
    old = next(c for c in baseline["checks"] if c["id"] == check["id"])
    for record, margin in ((old, 0.01), (check, 0.5)):
        metrics = record["metrics"]
        metrics.update(truth={"available": False, "reason": "test"}, gate_ratio=margin)
        metrics["criteria"] = [c for c in metrics["criteria"] if c["gate"] != "relative"]
        criterion(record, "margin").update(value=margin)
    skipped = next(c for c in report["checks"] if c["id"] == "T8-bf16-layer")
    skipped.update(status="skipped", message="adapter lost its bf16 path")
    (tmp_path / "new.json").write_text(json.dumps(report))
    (tmp_path / "old.json").write_text(json.dumps(baseline))
    assert main(["gate", str(tmp_path / "new.json"), "--baseline", str(tmp_path / "old.json")]) == 1
    out = capsys.readouterr().out
    assert (
        "T8-fp32-decode-k8: error grew over the baseline: ratio to the limit 0.01 → 0.5 (×50, allowed ×2)"
        in out
    )
    assert "T8-bf16-layer: passed in the baseline, now skipped: adapter lost its bf16 path" in out
    assert (
        main(
            [
                "gate",
                str(tmp_path / "new.json"),
                "--baseline",
                str(tmp_path / "old.json"),
                "--growth-factor",
                "100",
            ]
        )
        == 1
    )  # the skip still counts


def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, synthetic_dumps: Path) -> None:
    result = _run("run", "--dumps", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {tmp_path / 'missing'}: no such dump set (the folder does not exist); "
        "leave --dumps out for the golden set the package carries; a dump set is made by "
        "`python -m dump_gen --out DIR`, or read from the gs:// URL it was written to"
    )
    result = _run("run", "--dumps", str(synthetic_dumps), "--impl", "no_such_module:Adapter")
    assert result.returncode == 2 and "no module named 'no_such_module'" in result.stderr
    (tmp_path / "bad.json").write_text("{}")
    assert main(["gate", str(tmp_path / "bad.json")]) == 2


def test_diff_names_the_first_stage_out_of_tolerance(
    synthetic_dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png = tmp_path / "g.png"
    diff = ["diff", "--dumps", str(synthetic_dumps), "--case", "varlen_initstate"]
    code = main([*diff, "--impl", "tests.conformance.broken_adapters:NumpyFlippedGate", "--png", str(png)])
    out = capsys.readouterr().out
    assert code == 1
    assert "first out of tolerance: gate/beta (g):" in out
    assert png.read_bytes().startswith(b"\x89PNG")
    code = main([*diff, "--dtype", "bf16", "--impl", NUMPY_IMPL])
    assert code == 0 and "every stage compared holds" in capsys.readouterr().out
