"""Installing the package into an implementation's own environment changes none of its JAX stack: pip's
dry run of `kda-conformance[kda-impl]` in a virtualenv holding sgl-jax's pins (jax 0.10.2, jaxlib 0.10.2,
flax 0.12.4) installs none of them anew. It asks the package index (PyPI)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SGL_JAX_PINS = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.4"}


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.mark.pypi
def test_installing_beside_sgl_jax_pins_changes_none_of_them(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The pins as installed dists: pip judges an environment by its dists' metadata. Without their own
    # dependencies, which the dry run then lists, and which are not what it must leave alone.
    _pip(
        python,
        "install",
        "-q",
        "--no-deps",
        *(f"{name}=={version}" for name, version in SGL_JAX_PINS.items()),
    )
    # The package's metadata alone (pyproject.toml, and the README it names), built outside the checkout.
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    report = tmp_path / "report.json"
    _pip(python, "install", "-q", "--dry-run", "--report", str(report), f"{project}[kda-impl]")
    would_install = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "kda-conformance" in would_install
    assert {name: would_install[name] for name in SGL_JAX_PINS if name in would_install} == {}
