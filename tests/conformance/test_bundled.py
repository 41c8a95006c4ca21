"""The golden set the package carries: found in a checkout (and in a wheel: tests/packaging/test_wheel.py),
the default of every `--dumps` a user may leave out, and named as such in the reports."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.dumps import bundled
from conformance.dumps.reader import DumpSet

REPO = Path(__file__).resolve().parents[2]
DIGEST = hashlib.sha256((REPO / "golden" / "manifest.json").read_bytes()).hexdigest()


def test_a_checkout_carries_its_golden_folder() -> None:
    assert bundled.bundled_golden() == REPO / "golden"
    assert bundled.dumps_or_bundled(None) == str(REPO / "golden")
    assert bundled.dumps_or_bundled("other") == "other"


def test_the_label_says_bundled_however_the_folder_is_spelled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(REPO)
    label = f"golden (bundled, manifest sha256 {DIGEST})"
    assert DumpSet("golden").label == label == DumpSet(str(REPO / "golden")).label
    assert bundled.dump_set_label("gs://bucket/kda", DIGEST) == f"gs://bucket/kda (manifest sha256 {DIGEST})"
    assert not bundled.is_bundled(str(tmp_path))


def test_verify_without_dumps_checks_the_bundled_set(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify"]) == 0
    assert capsys.readouterr().out == (
        f"golden (bundled, manifest sha256 {DIGEST}): format v1, 12 cases, 14 files, "
        "every sha256 and key checked: ok\n"
    )


def test_an_install_without_the_set_says_so_on_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(bundled, "candidates", lambda name: (tmp_path / "a", tmp_path / "b"))
    assert main(["verify"]) == 2
    assert capsys.readouterr().err == (
        f"error: the package carries no golden dump set (no {tmp_path / 'a' / 'manifest.json'} or "
        f"{tmp_path / 'b' / 'manifest.json'}); give --dumps DIR_OR_URL\n"
    )


def test_the_glm5_next_set_is_bundled_and_named_from_anywhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """golden-glm5-next/ is found like golden/, `--dumps golden-glm5-next` names it where no folder of that
    name is (a wheel's user), its reports say bundled, and its manifest is of the glm5-next family."""
    folder = REPO / bundled.GLM5_NEXT_NAME
    assert bundled.bundled_set(bundled.GLM5_NEXT_NAME) == folder
    monkeypatch.chdir(tmp_path)
    assert bundled.dumps_or_bundled(bundled.GLM5_NEXT_NAME) == str(folder)
    dumps = DumpSet(bundled.dumps_or_bundled(bundled.GLM5_NEXT_NAME))
    digest = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    assert dumps.label == f"golden-glm5-next (bundled, manifest sha256 {digest})"
    assert dumps.config.family == "glm5-next" and dumps.config.gate_lower_bound == -5.0
    (tmp_path / bundled.GLM5_NEXT_NAME).mkdir()  # a folder of that name here is read as a path
    assert bundled.dumps_or_bundled(bundled.GLM5_NEXT_NAME) == bundled.GLM5_NEXT_NAME


def test_the_wheel_maps_every_bundled_set() -> None:
    """setup.py's package_dir and pyproject's package-data name each bundled set's package folder."""
    setup = (REPO / "setup.py").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    for name, package in bundled.PACKAGE_FOLDERS.items():
        assert f'"conformance.{package}": "{name}"' in setup, name
        assert f'"conformance.{package}.cases": "{name}/cases"' in setup, name
        assert f'"conformance.{package}" = ["manifest.json", "weights.npz", "README.md"]' in pyproject, name
        assert f'"conformance.{package}.cases" = ["*.npz"]' in pyproject, name
