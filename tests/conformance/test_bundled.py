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
