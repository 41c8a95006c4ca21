"""The pytest plugin: inert without --kda-impl; with it, the suite beside a repository's own tests, with
the ids, reports and exit status of `kda-conform run`. Each run is a pytest of its own, in a folder
outside the checkout, with the plugin named by `-p`: by its entry point's name where this environment
has the package's metadata (pytest would refuse the module registered under a second name), else by
its module (the entry point alone is tested from the wheel: tests/packaging/test_wheel.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUMPY_IMPL = "tests.conformance.numpy_adapter:NumpyAdapter"
OWN_TEST = "def test_own():\n    assert True\n"
ENTRY_POINT = "kda_conformance"
PLUGIN = ENTRY_POINT if entry_points(group="pytest11", name=ENTRY_POINT) else "conformance.suite.plugin"


def _host(tmp_path: Path) -> Path:
    """A repository of its own: one test of its own."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "test_own.py").write_text(OWN_TEST)
    return host


def _pytest(host: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the checkout's packages, and the tests' adapters
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", *args],
        cwd=host,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _summary(stdout: str) -> list[str]:
    """The lines of the KDA conformance section, the verdict line first."""
    return [line for line in stdout[stdout.index("KDA conformance") :].splitlines()[1:] if line]


def test_without_kda_impl_the_plugin_adds_its_options_only(tmp_path: Path) -> None:
    host = _host(tmp_path)
    done = _pytest(host, "-q")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    assert "KDA conformance" not in done.stdout and not (host / "reports").exists()
    assert "--kda-impl=NAME_OR_MODULE:ATTR" in _pytest(host, "--help").stdout


def test_the_suite_runs_beside_the_repositorys_tests_as_run_runs_it(
    tmp_path: Path, synthetic_dumps: Path
) -> None:
    host = _host(tmp_path)
    selection = ["--cases", "T8", "--dtypes", "fp32"]
    plugin = _pytest(
        host,
        "-v",
        "--kda-impl",
        NUMPY_IMPL,
        "--kda-dumps",
        str(synthetic_dumps),
        *(f"--kda-{arg[2:]}" if arg.startswith("--") else arg for arg in selection),
    )
    assert plugin.returncode == 0, plugin.stdout[-3000:] + plugin.stderr[-3000:]
    assert "test_own.py::test_own PASSED" in plugin.stdout
    assert "conformance/suite/test_conformance.py::test_check[T8-fp32-layer] PASSED" in plugin.stdout
    run_args = ["--dumps", str(synthetic_dumps), "--impl", NUMPY_IMPL, *selection]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "run",
            *run_args,
            "--report-dir",
            str(tmp_path / "run"),
            "--",
            "-v",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "conformance/suite/test_conformance.py::test_check[T8-fp32-layer] PASSED" in run.stdout
    reports = {
        name: json.loads((folder / "report.json").read_text())
        for name, folder in (("plugin", host / "reports" / "kda-conformance"), ("run", tmp_path / "run"))
    }
    checks = {name: [(c["id"], c["status"]) for c in report["checks"]] for name, report in reports.items()}
    assert checks["plugin"] == checks["run"] and len(checks["run"]) > 10
    assert reports["plugin"]["summary"] == reports["run"]["summary"]
    assert reports["plugin"]["dumps"] == reports["run"]["dumps"]
    assert _summary(plugin.stdout)[:5] == _summary(run.stdout)[:5]  # verdict, dumps, platform, kernels
    assert (host / "reports" / "kda-conformance" / "junit.xml").is_file()


@pytest.mark.parametrize(
    ("impl", "extra", "code", "says"),
    [
        ("tests.conformance.broken_adapters:NumpyFlippedGate", [], 1, "FAIL: "),
        ("tests.conformance.untrusted_adapters:EveryCallRaises", [], 3, "ERROR: "),
        ("tests.conformance.untrusted_adapters:ConstructorRaises", [], 3, "Exit: kda-conformance: "),
        (NUMPY_IMPL, ["-k", "test_own"], 2, "error: nothing was checked: -k 'test_own' matches no check"),
        (NUMPY_IMPL, ["--kda-cases", "T9999"], 2, "Exit: kda-conformance: "),
    ],
    ids=["out-of-tolerance", "implementation-fault", "constructor-raises", "nothing-checked", "no-such-case"],
)
def test_the_exit_status_is_runs(
    tmp_path: Path, synthetic_dumps: Path, impl: str, extra: list[str], code: int, says: str
) -> None:
    done = _pytest(
        _host(tmp_path), "--kda-impl", impl, "--kda-dumps", str(synthetic_dumps), "--kda-dtypes", "fp32",
        *(["--kda-cases", "T8"] if "--kda-cases" not in extra else []), *extra,
    )  # fmt: skip
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-3000:]
    assert says in done.stdout + done.stderr


def test_a_missing_dump_set_and_xdist_are_one_line_and_exit_2(tmp_path: Path) -> None:
    host = _host(tmp_path)
    done = _pytest(host, "--kda-impl", NUMPY_IMPL, "--kda-dumps", str(tmp_path / "missing"))
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"Exit: kda-conformance: {tmp_path / 'missing'}: no such dump set")
    done = _pytest(host, "--kda-impl", NUMPY_IMPL, "-n", "2")
    assert done.returncode == 2
    assert "--kda-impl runs the suite in one process: add -p no:xdist (or -n 0)" in done.stderr
