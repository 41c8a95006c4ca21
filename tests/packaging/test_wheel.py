"""The wheel as another repository uses it: built from the checkout, installed into a fresh virtualenv
beside sgl-jax's pins (jax 0.10.2, jaxlib 0.10.2, flax 0.12.4) with no extra, and every command run
from an empty folder: `run` on the golden set the wheel carries, `gate`, `diff`, `verify`, `search`,
the pytest plugin beside a test of the folder's own, and the one-line errors of a missing extra. It
asks the package index (PyPI) for the wheel's dependencies."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conformance.dumps.bundled import PACKAGE_FOLDERS
from tests.packaging.venvs import SGL_JAX_PINS, fresh_venv, pin_args, pip

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from: the checkout's tracked sources, copied so that the build leaves nothing
# in the checkout.
BUILD_INPUTS = (
    *("pyproject.toml", "setup.py", "README.md"),
    *("kda_spec", "kda_impl", "dump_gen", "conformance", "golden", "golden-glm5-next"),
)
GOLDEN = REPO / "golden"
COMMAND_TIMEOUT_S = 600


def _copy_sources(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    return source


def _build_wheel(tmp_path: Path) -> Path:
    source = _copy_sources(tmp_path)
    pip(Path(sys.executable), "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("kda_conformance-*.whl")
    return wheel


def _installed_versions(python: Path) -> dict[str, str]:
    listed = json.loads(pip(python, "list", "--format", "json").stdout)
    return {item["name"].lower(): item["version"] for item in listed}


class Folder:
    """An empty folder outside the checkout, and the virtualenv's commands run in it."""

    def __init__(self, path: Path, venv: Path, cache: Path):
        self.path = path
        self.bin = venv / "bin"
        path.mkdir()
        environ = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        self.env = {
            **environ,
            "PATH": f"{self.bin}{os.pathsep}{environ['PATH']}",
            "JAX_COMPILATION_CACHE_DIR": str(cache),  # shared by the commands here, nothing left in ~
        }

    def run(self, command: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin / command), *args],
            cwd=self.path,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )


def _conformance_section(stdout: str) -> list[str]:
    return [line for line in stdout[stdout.index("KDA conformance") :].splitlines()[1:] if line]


def _first_error_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, never a traceback
    return lines[0]


@pytest.mark.pypi
def test_every_command_works_from_the_wheel_beside_sgl_jax_pins(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    carried = zipfile.ZipFile(wheel).namelist()
    for package in PACKAGE_FOLDERS.values():  # both golden sets, each whole
        assert f"conformance/{package}/manifest.json" in carried, package
        assert f"conformance/{package}/README.md" in carried, package
    assert sum(name.startswith("conformance/golden_glm5_next/cases/") for name in carried) == len(
        list((REPO / "golden-glm5-next" / "cases").glob("*.npz"))
    )
    python = fresh_venv(tmp_path / "venv")
    pip(python, "install", "-q", *pin_args())  # sgl-jax's environment, as it was before
    pip(python, "install", "-q", str(wheel))  # the package, with no extra
    versions = _installed_versions(python)
    assert {name: versions[name] for name in SGL_JAX_PINS} == SGL_JAX_PINS
    assert not {"matplotlib", "gcsfs", "torch"} & set(versions)

    folder = Folder(tmp_path / "empty", tmp_path / "venv", tmp_path / "jax-cache")
    digest = hashlib.sha256((GOLDEN / "manifest.json").read_bytes()).hexdigest()
    label = f"golden (bundled, manifest sha256 {digest})"

    done = folder.run("kda-conform", "run", "--cases", "T8", "T65", "--dtypes", "fp32")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = _conformance_section(done.stdout)
    assert summary[:2] == ["PASS: 108 checked, 0 skipped", f"dumps: {label}, family kimi-linear"]
    report = json.loads((folder.path / "reports" / "report.json").read_text())
    assert report["dumps"]["bundled"] is True and report["dumps"]["label"] == label
    assert "site-packages" in report["dumps"]["url"]  # the wheel's copy, not the checkout's

    done = folder.run("kda-conform", "gate", "reports/report.json")
    assert (
        done.returncode == 0
        and done.stdout.splitlines()[0] == "gate: ok (108 passed, 0 failed, 0 error, 0 skipped)"
    )

    done = folder.run("kda-conform", "verify")
    assert done.returncode == 0
    assert (
        done.stdout.splitlines()[0]
        == f"{label}: format v1, 12 cases, 14 files, every sha256 and key checked: ok"
    )

    done = folder.run("kda-conform", "diff", "--case", "T8")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "T8 (fp32), implementation kda_impl, kernel auto"

    done = folder.run(
        "kda-conform", "search", "--impl", "kda_impl", "--budget", "10", "--out", "s", "--no-progress"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert next(line for line in done.stdout.splitlines() if line.startswith("search: "))
    assert (folder.path / "s" / "search.json").is_file()

    (folder.path / "test_own.py").write_text("def test_own():\n    assert True\n")
    done = folder.run("pytest", "--kda-impl", "kda_impl", "--kda-cases", "T8", "--kda-dtypes", "fp32")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _conformance_section(done.stdout)[:2] == [
        "PASS: 54 checked, 0 skipped",
        f"dumps: {label}, family kimi-linear",
    ]
    assert "55 passed" in done.stdout.splitlines()[-1]
    done = folder.run("pytest", "test_own.py")  # inert without --kda-impl
    assert done.returncode == 0 and "KDA conformance" not in done.stdout

    done = folder.run("kda-conform", "diff", "--case", "T8", "--png", "t8.png")
    assert done.returncode == 2 and _first_error_line(done) == (
        "error: diff --png needs matplotlib, which is not installed: pip install 'kda-conformance[png]'"
    )
    done = folder.run("kda-conform", "verify", "--dumps", "gs://bucket/kda")
    assert done.returncode == 2 and _first_error_line(done) == (
        "error: gs://bucket/kda needs gcsfs, which is not installed: pip install 'kda-conformance[gcs]'"
    )
    done = folder.run("kda-dump", "--out", "dumps", "--preset", "mini")
    assert done.returncode == 2 and _first_error_line(done).startswith(
        "dump_gen: error: making a dump set needs torch, which is not installed: "
        "pip install 'kda-conformance[torch-cpu]'"
    )


@pytest.mark.pypi
def test_an_editable_install_reads_the_checkouts_golden(tmp_path: Path) -> None:
    """`pip install -e` (what the make targets do) of a checkout: the plugin's entry point, and the
    bundled set is the checkout's golden/ itself."""
    source = _copy_sources(tmp_path)
    python = fresh_venv(tmp_path / "venv")
    pip(python, "install", "-q", "--no-deps", "-e", str(source))
    pip(python, "install", "-q", "numpy", "ml_dtypes")  # what the bundled set's module imports, no more
    script = (
        "from importlib.metadata import entry_points\n"
        "from conformance.dumps.bundled import bundled_golden\n"
        "print(bundled_golden())\n"
        "print(*(f'{e.name}={e.value}' for e in entry_points(group='pytest11')))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(source / "golden"), "kda_conformance=conformance.suite.plugin"]
