"""Unusable input is exit 2 and one `error:` line, never a traceback or exit 1; a run's reports on disk
are always its own; paths in a manifest stay inside the set."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance.cli import main
from conformance.dumps.safe_npz import NpzError, load_npz
from kda_spec import dump_format as fmt
from tests.conformance.synthetic import write_dump_set

REPO = Path(__file__).resolve().parents[2]
NUMPY_IMPL = "tests.conformance.numpy_adapter:NumpyAdapter"


@pytest.fixture(scope="module")
def small_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dump_set(
        tmp_path_factory.mktemp("small"), ("T1", "T8"), dtypes=("fp32",), intermediates=False
    )


@pytest.fixture
def dumps(small_set: Path, tmp_path: Path) -> Path:
    """A private copy of the small set that a test may break."""
    return Path(shutil.copytree(small_set, tmp_path / "dumps"))


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((root / fmt.MANIFEST_FILE).read_text())
    edit(manifest)
    (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))


def _add_member(root: Path, case_id: str, name: str, data: bytes) -> None:
    """Add a member to a case file and record the file's new sha256: well-formed checksums, bad content."""
    path = root / f"cases/{case_id}.npz"
    buffer = io.BytesIO(path.read_bytes())
    with zipfile.ZipFile(buffer, "a") as archive:
        archive.writestr(name, data)
    path.write_bytes(buffer.getvalue())
    digest = fmt.sha256_bytes(buffer.getvalue())
    _edit_manifest(root, lambda m: next(c for c in m["cases"] if c["id"] == case_id).update(sha256=digest))


def _npy_header(descr: Any, shape: tuple[int, ...], payload: bytes = b"\0" * 64) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue() + payload


def _error_line(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run a command that must refuse its input: exit 2, one `error:` line, the problems listed below."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines[0].startswith("error: ") and all(line.startswith("  ") for line in lines[1:]), err
    return err.strip()


# ------------------------------------------------------------------------------ paths inside the set


@pytest.mark.parametrize("outside", ["absolute", "../outside/weights.npz"])
def test_a_weights_file_outside_the_set_is_refused(dumps: Path, capsys, outside: str) -> None:
    (dumps.parent / "outside").mkdir()
    target = shutil.copy(dumps / fmt.WEIGHTS_FILE, dumps.parent / "outside/weights.npz")
    path = str(target) if outside == "absolute" else outside
    _edit_manifest(dumps, lambda m: m["weights"].update(file=path))
    err = _error_line(capsys, ["verify", "--dumps", str(dumps)])
    assert "manifest.json: weights.file must be a relative path inside the set" in err and repr(path) in err


@pytest.mark.parametrize(
    "path",
    ["cases\\T8.npz", "C:/cases/T8.npz", "file:///tmp/T8.npz", "cases/../cases/T8.npz", "./cases/T8.npz"],
)
def test_a_case_file_that_is_not_a_plain_relative_path_is_refused(dumps: Path, capsys, path: str) -> None:
    _edit_manifest(dumps, lambda m: m["cases"][1].update(file=path))
    err = _error_line(capsys, ["verify", "--dumps", str(dumps)])
    assert "cases[1]: 'file' must be a relative path inside the set" in err and repr(path) in err


@pytest.mark.parametrize("path", ["\x1e", "cases/T8\n.npz", "weights\u2028.npz"])
def test_a_file_name_with_a_control_character_is_refused_on_one_line(dumps: Path, capsys, path: str) -> None:
    _edit_manifest(dumps, lambda m: m["weights"].update(file=path))
    err = _error_line(capsys, ["verify", "--dumps", str(dumps)])
    assert "weights.file must be a file name of printable characters" in err and repr(path) in err


# ------------------------------------------------------------------------------ manifest field types

MANIFEST_EDITS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "hidden_size null": (
        lambda m: m["config"].update(hidden_size=None),
        "config.hidden_size must be an integer",
    ),
    "hidden_size 1.5": (
        lambda m: m["config"].update(hidden_size=1.5),
        "config.hidden_size must be an integer",
    ),
    "num_heads true": (lambda m: m["config"].update(num_heads=True), "config.num_heads must be an integer"),
    "rms_norm_eps text": (
        lambda m: m["config"].update(rms_norm_eps="x"),
        "config.rms_norm_eps must be a finite",
    ),
    "config 5": (lambda m: m.update(config=5), "'config' must be an object, found 5"),
    "keys 5": (lambda m: m["cases"][0].update(keys=5), "cases[0]: 'keys' must be a list of strings"),
    "keys [1]": (lambda m: m["cases"][0].update(keys=[1]), "cases[0]: 'keys' must be a list of strings"),
    "seq_lens 5": (
        lambda m: m["cases"][0].update(seq_lens=5),
        "'seq_lens' must be a list of positive integers",
    ),
    "seq_lens [true]": (
        lambda m: m["cases"][0].update(seq_lens=[True]),
        "'seq_lens' must be a list of positive",
    ),
    "sha256 5": (lambda m: m["cases"][0].update(sha256=5), "cases[0]: 'sha256' must be a sha256"),
    "id [1]": (lambda m: m["cases"][0].update(id=[1]), "cases[0]: 'id' must be a non-empty string"),
    "initial_state 'yes'": (
        lambda m: m["cases"][0].update(initial_state="yes"),
        "'initial_state' must be true",
    ),
    "layer_kernel_path 5": (
        lambda m: m["cases"][0].update(layer_kernel_path=5),
        "'layer_kernel_path' must be",
    ),
    "weights 5": (lambda m: m.update(weights=5), "'weights' must be an object, found 5"),
    "weights.sha256 null": (lambda m: m["weights"].update(sha256=None), "weights.sha256 must be a sha256"),
    "weights.file 5": (lambda m: m["weights"].update(file=5), "weights.file must be a non-empty string"),
}


@pytest.mark.parametrize("name", list(MANIFEST_EDITS))
def test_a_manifest_field_of_the_wrong_type_is_one_line(dumps: Path, capsys, name: str) -> None:
    edit, message = MANIFEST_EDITS[name]
    _edit_manifest(dumps, edit)
    err = _error_line(capsys, ["verify", "--dumps", str(dumps)])
    assert err == f"error: {dumps}/manifest.json: {err.split('manifest.json: ', 1)[1]}" and message in err


# ------------------------------------------------------------------------------------ npz members

MEMBERS = {
    "not an .npy": ("notes.txt", b"hello", "member 'notes.txt' is not an .npy array"),
    "2**50 elements": (
        "extra.npy",
        _npy_header("<f4", (2**50,)),
        "member 'extra.npy': header declares shape (1125899906842624,) of float32 (4503599627370496 "
        "bytes), the member holds 64 bytes",
    ),
    "object dtype": ("extra.npy", _npy_header("|O", (4,)), "member 'extra.npy': dtype object is not a plain"),
    "structured dtype": (
        "extra.npy",
        _npy_header([("a", "<f4")], (4,)),
        "dtype [('a', '<f4')] is not a plain",
    ),
    "a short payload": ("extra.npy", _npy_header("<f4", (32,)), "the member holds 64 bytes"),
    "a broken header": (
        "extra.npy",
        b"\x93NUMPY\x01\x00\x10\x00{'descr': 5}    ",
        "member 'extra.npy': not a readable .npy (ValueError: Header does not contain the correct keys",
    ),
}


@pytest.mark.parametrize("name", list(MEMBERS))
def test_a_bad_npz_member_is_named_before_anything_is_allocated(dumps: Path, capsys, name: str) -> None:
    member, data, message = MEMBERS[name]
    _add_member(dumps, "T8", member, data)
    err = _error_line(capsys, ["verify", "--dumps", str(dumps)])
    assert f"{dumps}/cases/T8.npz: " in err and message in err


def test_load_npz_reads_what_numpy_wrote() -> None:
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "f": np.asfortranarray(np.eye(3))}
    for save in (np.savez, np.savez_compressed):
        buffer = io.BytesIO()
        save(buffer, **arrays)
        loaded = load_npz(buffer.getvalue())
        assert loaded.keys() == arrays.keys()
        assert all(
            np.array_equal(loaded[k], arrays[k]) and loaded[k].dtype == arrays[k].dtype for k in arrays
        )
    with pytest.raises(NpzError, match=r"not a readable \.npz file"):
        load_npz(b"not a zip")


# ------------------------------------------------------------------------- run's reports and outputs


def test_a_run_that_stops_leaves_no_previous_report(dumps: Path, tmp_path: Path, capsys) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    for name in ("report.json", "report.md", "junit.xml"):
        (reports / name).write_text("from the previous run")
    data = bytearray((dumps / "cases/T8.npz").read_bytes())
    data[300] ^= 0xFF
    (dumps / "cases/T8.npz").write_bytes(bytes(data))
    err = _error_line(
        capsys, ["run", "--dumps", str(dumps), "--impl", NUMPY_IMPL, "--report-dir", str(reports)]
    )
    assert "cases/T8.npz: sha256 mismatch" in err
    assert sorted(path.name for path in reports.iterdir()) == []


def test_an_unwritable_report_dir_or_png_is_one_line(small_set: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "a-file").write_text("")
    below_a_file = tmp_path / "a-file/reports"
    err = _error_line(capsys, ["run", "--dumps", str(small_set), "--report-dir", str(below_a_file)])
    assert err.startswith(f"error: --report-dir {below_a_file}: cannot write the reports there")
    png = tmp_path / "no-such-folder/heat.png"
    argv = ["diff", "--dumps", str(small_set), "--case", "T8", "--impl", NUMPY_IMPL, "--png", str(png)]
    assert _error_line(capsys, argv) == f"error: --png {png}: cannot write there (No such file or directory)"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", "run", "--impl", NUMPY_IMPL, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_in_which_no_check_ran_exits_2(small_set: Path, tmp_path: Path) -> None:
    result = _run("--dumps", str(small_set), "--dtypes", "bf16", "--report-dir", str(tmp_path / "a"))
    assert result.returncode == 2, result.stdout[-2000:]
    assert result.stderr.strip().startswith("error: nothing was checked: all ") and "checks were skipped" in (
        result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1
    result = _run("--dumps", str(small_set), "-k", "no_such_check", "--report-dir", str(tmp_path / "b"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: nothing was checked: -k 'no_such_check' matches no check "
        "(check ids read <case>-<dtype>-<check>, as T65-fp32-layer)"
    )
