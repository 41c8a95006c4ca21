"""Installing the package into an implementation's own environment changes none of its JAX stack: pip's
dry run of `kda-conformance[kda-impl]` in a virtualenv holding sgl-jax's pins (jax 0.10.2, jaxlib 0.10.2,
flax 0.12.4) installs none of them anew. It asks the package index (PyPI)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.packaging.venvs import SGL_JAX_PINS, fresh_venv, pin_args, pip

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.pypi
def test_installing_beside_sgl_jax_pins_changes_none_of_them(tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv")
    # The pins as installed dists: pip judges an environment by its dists' metadata. Without their own
    # dependencies, which the dry run then lists, and which are not what it must leave alone.
    pip(python, "install", "-q", "--no-deps", *pin_args())
    # The package's metadata alone (pyproject.toml, and the README it names), built outside the checkout.
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    report = tmp_path / "report.json"
    pip(python, "install", "-q", "--dry-run", "--report", str(report), f"{project}[kda-impl]")
    would_install = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "kda-conformance" in would_install
    assert {name: would_install[name] for name in SGL_JAX_PINS if name in would_install} == {}
