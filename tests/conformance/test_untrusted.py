"""The implementation under test cannot fool, flood, stall or half-finish the arbiter.

Each adapter of tests/conformance/untrusted_adapters.py runs through `python -m conformance run` on the
synthetic set (two cases, fp32): the verdict of its checks, the exit code and the size of what it
prints and writes are asserted against the honest numpy reference's run. A hang, SIGINT and SIGTERM run
in a subprocess (the call timeout ends its process), and `gate` refuses what they leave.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.cli import main

REPO = Path(__file__).resolve().parents[2]
ATTACKS = "tests.conformance.untrusted_adapters"
HONEST = "tests.conformance.numpy_adapter:NumpyAdapter"
CASES = ("T8", "varlen_initstate")
# the checks of the two cases in fp32, the 8 raw-gate, 2 checkpoint, 12 kernel gradient, 34 layer gradient
# and 8 causality checks among them
PLANNED = 108


def _run_args(dumps: Path, impl: str, report_dir: Path, *extra: str) -> list[str]:
    return [
        "run", "--dumps", str(dumps), "--impl", impl, "--cases", *CASES, "--dtypes", "fp32",
        "--report-dir", str(report_dir), *extra,
    ]  # fmt: skip


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


def _statuses(report_dir: Path) -> dict[str, tuple[str, str]]:
    report = json.loads((report_dir / "report.json").read_text())
    return {check["id"]: (check["status"], check["message"]) for check in report["checks"]}


class Run:
    def __init__(self, code: int, output: str, report_dir: Path):
        self.code, self.output, self.report_dir = code, output, report_dir


def _run_in_process(capfd: pytest.CaptureFixture, args: list[str]) -> Run:
    code = main(args)
    out, err = capfd.readouterr()
    return Run(code, out + err, Path(args[args.index("--report-dir") + 1]))


@pytest.fixture(scope="module")
def honest(synthetic_dumps: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The numpy reference itself: what an honest run prints and writes."""
    report_dir = tmp_path_factory.mktemp("honest")
    result = subprocess.run(
        [sys.executable, "-m", "conformance", *_run_args(synthetic_dumps, HONEST, report_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return Run(result.returncode, result.stdout + result.stderr, report_dir)


def expected_kind(code: int) -> str:
    """The status of the checks an adapter breaks: an error where it faults (exit 3), else a failure."""
    return "error" if code == 3 else "failed"


# adapter → (exit code, {check id: status}, a text in the message of each listed check of the broken
# kind: `error` for a fault, `failed` for a result out of tolerance)
EXPECTED = {
    "WrongRecurrentGDoubledInPlace": (
        3,
        {"T8-fp32-kernel-recurrent": "failed", "T8-fp32-kernel-chunk": "error", "T8-fp32-layer": "passed"},
        "chunk_kernel: wrote into its argument(s) ['g']",
    ),
    "VScaledInPlace": (
        3,
        {
            "T8-fp32-kernel-chunk": "error",
            "T8-fp32-kernel-recurrent": "passed",
            "T8-fp32-v_after_conv": "passed",
            "varlen_initstate-fp32-kernel-recurrent-state": "passed",
        },
        "chunk_kernel: wrote into a read-only argument",
    ),
    "StateIntoInitialState": (
        3,
        {
            "varlen_initstate-fp32-layer": "error",
            "varlen_initstate-fp32-decode-k8": "error",
            "T8-fp32-layer": "passed",
            "T8-fp32-chunked-prefill-state": "passed",
            "varlen_initstate-fp32-kernel-chunk-state": "passed",
        },
        "layer_extend: wrote into its argument(s) ['initial_state']",
    ),
    "EveryCallRaises": (
        3,
        {
            "T8-fp32-layer": "error",
            "T8-fp32-kernel-chunk": "error",
            "varlen_initstate-fp32-decode-k1": "error",
        },
        "implementation raised: ",
    ),
    "ExtraAxis": (
        3,
        {
            "T8-fp32-layer": "error",
            "T8-fp32-decode-k1": "error",
            "T8-fp32-decode-k1-self": "error",
            "T8-fp32-chunked-prefill": "error",
            "T8-fp32-kernel-chunk": "passed",
        },
        "out must have shape [",
    ),
    "Float64Out": (3, {"T8-fp32-layer": "error", "T8-fp32-kernel-chunk": "passed"}, "out has dtype float64"),
    "ListOut": (3, {"T8-fp32-layer": "error"}, "out must be an array"),
    "NaNOut": (1, {"T8-fp32-layer": "failed", "T8-fp32-kernel-chunk": "passed"}, "NaN"),
    "ReusedBuffers": (0, {"T8-fp32-layer": "passed", "varlen_initstate-fp32-decode-k8": "passed"}, ""),
}


@pytest.mark.parametrize("adapter", list(EXPECTED))
def test_an_adapter_cannot_fool_or_flood_the_suite(
    adapter: str, honest: Run, synthetic_dumps: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    code, expected, text = EXPECTED[adapter]
    run = _run_in_process(capfd, _run_args(synthetic_dumps, f"{ATTACKS}:{adapter}", tmp_path))
    assert run.code == code, run.output[-3000:]
    statuses = _statuses(tmp_path)
    for check_id, status in expected.items():
        assert statuses[check_id][0] == status, (check_id, statuses[check_id])
        if status == expected_kind(code):
            assert text in statuses[check_id][1], statuses[check_id]
    # What it prints is bounded: the honest run's output, one traceback and a line per distinct failure.
    assert len(run.output) < len(honest.output) + 6000, run.output
    assert run.output.count("Traceback (most recent call last)") <= 3
    assert _folder_bytes(tmp_path) <= _folder_bytes(honest.report_dir) * 1.2
    if code == 3:
        assert main(["gate", str(tmp_path / "report.json")]) == 3


def test_an_adapter_that_cannot_be_built_stops_the_run_at_once(
    honest: Run, synthetic_dumps: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    run = _run_in_process(capfd, _run_args(synthetic_dumps, f"{ATTACKS}:ConstructorRaises", tmp_path))
    assert run.code == 3
    lines = run.output.splitlines()
    assert (
        lines[0].startswith("error: implementation raised: ConstructorRaises(")
        and "no device found" in lines[0]
    )
    assert sum(line.startswith("error:") for line in lines) == 1
    assert run.output.count("Traceback (most recent call last)") == 1
    assert "untrusted_adapters.py" in run.output and "guard.py" not in run.output
    assert len(run.output) < len(honest.output)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["completion"] == {
        "complete": False,
        "planned": PLANNED,
        "ran": 0,
        "stopped": report["completion"]["stopped"],
    }
    assert report["completion"]["stopped"].startswith("the implementation could not be built")
    assert main(["gate", str(tmp_path / "report.json")]) == 2


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("class Broken(:\n", "SyntaxError"),
        ("raise RuntimeError('the implementation is not installed')\n", "RuntimeError"),
        ("import a_package_that_is_not_installed\n", "ModuleNotFoundError"),
    ],
    ids=["syntax-error", "raises", "missing-dependency"],
)
def test_an_adapter_module_that_raises_on_import_is_one_error_line(
    source: str, error: str, synthetic_dumps: Path, tmp_path: Path
) -> None:
    (tmp_path / "my_adapter.py").write_text("# an adapter of the user's\n" + source)
    args = _run_args(synthetic_dumps, "my_adapter:Adapter", tmp_path / "r")
    result = subprocess.run(
        [sys.executable, "-m", "conformance", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: --impl 'my_adapter:Adapter': importing 'my_adapter' raised " + error)
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "my_adapter.py" in result.stderr and "importlib" not in result.stderr
    assert result.stdout == ""


def test_an_adapter_module_that_does_not_exist_is_a_usage_error(
    synthetic_dumps: Path, tmp_path: Path
) -> None:
    assert main(_run_args(synthetic_dumps, "no_such_module:Adapter", tmp_path)) == 2


def _subprocess_run(dumps: Path, impl: str, report_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "conformance", *_run_args(dumps, impl, report_dir, *extra)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _assert_incomplete_and_refused(report_dir: Path, baseline: Path, stopped: str) -> dict:
    report = json.loads((report_dir / "report.json").read_text())
    completion = report["completion"]
    assert not completion["complete"] and completion["ran"] < completion["planned"] == PLANNED, completion
    assert stopped in completion["stopped"]
    headline = (report_dir / "report.md").read_text().splitlines()[2]
    assert (
        headline.startswith("**INCOMPLETE**") and f"of {completion['planned']} planned checks ran" in headline
    )
    junit = (report_dir / "junit.xml").read_text()
    assert 'name="run-complete"' in junit and "incomplete: " in junit
    for extra in ([], ["--baseline", str(baseline)]):
        assert main(["gate", str(report_dir / "report.json"), *extra]) == 2
    return report


def test_a_hanging_call_is_stopped_by_the_call_timeout(
    honest: Run, synthetic_dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    started = time.monotonic()
    process = _subprocess_run(synthetic_dumps, f"{ATTACKS}:Hangs", tmp_path, "--call-timeout", "2")
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 3, stdout[-2000:] + stderr[-2000:]
    assert time.monotonic() - started < 60
    assert "error: implementation timeout: layer_extend did not return within 2 s" in stderr
    report = _assert_incomplete_and_refused(tmp_path, honest.report_dir / "report.json", "layer_extend")
    errored = [check for check in report["checks"] if check["status"] == "error"]
    assert [check["id"] for check in errored] == ["T8-fp32-layer"]
    assert "did not return within 2 s (--call-timeout 2)" in errored[0]["message"]
    assert report["faults"][0]["kind"] == "timeout"
    capsys.readouterr()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_leaves_a_report_marked_incomplete(
    signum: signal.Signals, honest: Run, synthetic_dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "answered"
    reports = tmp_path / "reports"
    process = _subprocess_run(
        synthetic_dumps, f"{ATTACKS}:SlowLayer", reports, "--impl-option", f"marker={marker}"
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stdout[-2000:] + stderr[-2000:]
    _assert_incomplete_and_refused(
        reports, honest.report_dir / "report.json", f"interrupted by {signum.name}"
    )
    capsys.readouterr()
