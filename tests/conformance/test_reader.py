"""The reader refuses a broken dump set with a message naming the file, the key, expected and found."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest

from conformance.cli import main
from conformance.dumps.reader import DumpError, DumpSet
from kda_spec import dump_format as fmt
from tests.conformance.synthetic import write_dump_set


@pytest.fixture
def dumps(synthetic_dumps: Path, tmp_path: Path) -> Path:
    """A private copy of the synthetic set that a test may break."""
    return Path(shutil.copytree(synthetic_dumps, tmp_path / "dumps"))


def _manifest(root: Path) -> dict:
    return json.loads((root / fmt.MANIFEST_FILE).read_text())


def _rewrite_case(root: Path, case_id: str, edit) -> None:
    """Apply `edit` to a case's arrays and store them with a matching checksum: well-formed but wrong."""
    manifest = _manifest(root)
    entry = next(c for c in manifest["cases"] if c["id"] == case_id)
    with np.load(root / entry["file"]) as npz:
        arrays = dict(npz)
    edit(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (root / entry["file"]).write_bytes(buffer.getvalue())
    entry["sha256"] = fmt.sha256_bytes(buffer.getvalue())
    (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))


def test_sound_set_reads_and_decodes_bf16_exactly(synthetic_dumps: Path) -> None:
    dumps = DumpSet(str(synthetic_dumps))
    assert dumps.verify() == []
    case = dumps.case("varlen_initstate")
    with np.load(synthetic_dumps / "cases/varlen_initstate.npz") as npz:
        bits = npz["out_bf16"]
    assert bits.dtype == np.uint16
    assert np.array_equal(case.result("out", "bf16"), fmt.bf16_bits_to_float32(bits))
    assert case.cu_seqlens.tolist() == [0, 5, 22, 23, 64]
    assert case.initial_state.shape == (4, 2, 8, 8)
    assert set(dumps.weights()) == set(fmt.weight_shapes(dumps.config.to_manifest()))


def test_corrupted_file_is_named_with_both_checksums(dumps: Path) -> None:
    path = dumps / "cases/T8.npz"
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        DumpError, match=r"cases/T8.npz: sha256 mismatch: manifest expects [0-9a-f]{64}, file has"
    ):
        DumpSet(str(dumps)).case("T8")


def test_wrong_checksum_in_manifest(dumps: Path) -> None:
    manifest = _manifest(dumps)
    manifest["weights"]["sha256"] = "0" * 64
    (dumps / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=f"weights.npz: sha256 mismatch: manifest expects {'0' * 64}"):
        DumpSet(str(dumps)).weights()


def test_a_case_renamed_in_the_manifest_is_refused(dumps: Path) -> None:
    """One flipped bit turns the id "T8" into "U8": the file still matches its checksum, so only the
    format's naming rule (a case lives in cases/<id>.npz) tells that the manifest was damaged."""
    manifest = _manifest(dumps)
    entry = next(c for c in manifest["cases"] if c["id"] == "T8")
    entry["id"] = "U8"
    (dumps / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(
        DumpError, match=r"case 'U8' must be in 'cases/U8.npz', the manifest says 'cases/T8.npz'"
    ):
        DumpSet(str(dumps))


def test_unknown_format_version(dumps: Path) -> None:
    manifest = _manifest(dumps)
    manifest["version"] = 2
    (dumps / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match="unknown format version 2; this reader knows version 1"):
        DumpSet(str(dumps))


def test_missing_key(dumps: Path) -> None:
    _rewrite_case(dumps, "T65", lambda arrays: arrays.pop("out_fp32"))
    with pytest.raises(
        DumpError, match=r"cases/T65.npz: key\(s\) \['out_fp32'\] listed in the manifest are missing"
    ):
        DumpSet(str(dumps)).case("T65")


def test_wrong_shape_and_dtype_name_expected_and_found(dumps: Path) -> None:
    _rewrite_case(dumps, "T8", lambda arrays: arrays.update(g=arrays["g"][:-1]))
    with pytest.raises(
        DumpError, match=r"cases/T8.npz: key 'g': expected shape \(8, 2, 8\), found \(7, 2, 8\)"
    ):
        DumpSet(str(dumps)).case("T8")
    _rewrite_case(dumps, "T8", lambda arrays: arrays.update(g=np.zeros((8, 2, 8), np.float64)))
    with pytest.raises(DumpError, match="key 'g': expected dtype float32, found float64"):
        DumpSet(str(dumps)).case("T8")


def test_missing_intermediates_and_cu_seqlens_are_tolerated(dumps: Path) -> None:
    def drop(arrays: dict) -> None:
        for key in [*fmt.INTERMEDIATE_KEYS, "cu_seqlens"]:
            arrays.pop(key)

    manifest = _manifest(dumps)
    next(c for c in manifest["cases"] if c["id"] == "T8")["keys"] = []
    (dumps / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    _rewrite_case(dumps, "T8", drop)
    case = DumpSet(str(dumps)).case("T8")
    assert case.result("g", "fp32") is None
    assert case.cu_seqlens.tolist() == [0, 8]


def test_missing_file_and_missing_set(dumps: Path, tmp_path: Path) -> None:
    (dumps / "cases/T1.npz").unlink()
    assert any("cases/T1.npz: file missing" in problem for problem in DumpSet(str(dumps)).verify())
    with pytest.raises(DumpError, match="no such dump set"):
        DumpSet(str(tmp_path / "nowhere"))


def test_reads_through_fsspec_urls(synthetic_dumps: Path) -> None:
    fs = fsspec.filesystem("memory")
    for path in synthetic_dumps.rglob("*"):
        if path.is_file():
            fs.pipe(f"/kda/{path.relative_to(synthetic_dumps)}", path.read_bytes())
    dumps = DumpSet("memory://kda")
    assert dumps.verify() == []
    assert dumps.case("T8").hidden_states.shape == (8, 32)


def test_verify_command_lists_every_problem(dumps: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--dumps", str(dumps)]) == 0
    (dumps / "cases/T8.npz").write_bytes(b"not a zip")
    _rewrite_case(dumps, "T65", lambda arrays: arrays.pop("hidden_states"))
    assert main(["verify", "--dumps", str(dumps)]) == 2
    err = capsys.readouterr().err
    assert "cases/T8.npz: sha256 mismatch" in err
    assert "cases/T65.npz: key(s) ['hidden_states'] listed in the manifest are missing" in err
    assert "Traceback" not in err


def test_unreadable_npz_with_matching_checksum(tmp_path: Path) -> None:
    root = write_dump_set(tmp_path / "d", ("T1",), dtypes=("fp32",))
    manifest = _manifest(root)
    (root / "cases/T1.npz").write_bytes(b"garbage")
    manifest["cases"][0]["sha256"] = fmt.sha256_bytes(b"garbage")
    (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=r"cases/T1.npz: not a readable .npz file"):
        DumpSet(str(root)).case("T1")


def test_each_file_is_read_and_checked_once_and_given_read_only(
    synthetic_dumps: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` verifies every file, then its checks read them again: each file is hashed once."""
    dumps = DumpSet(str(synthetic_dumps))
    hashed = []
    real_sha256 = fmt.sha256_bytes
    monkeypatch.setattr(fmt, "sha256_bytes", lambda data: hashed.append(len(data)) or real_sha256(data))
    assert dumps.verify() == []
    files = len(hashed)
    assert files == len(dumps.cases) + 1  # every case, and the weights
    weights, case = dumps.weights(), dumps.case(next(iter(dumps.cases)))
    assert len(hashed) == files  # nothing read again
    assert not any(array.flags.writeable for array in [*weights.values(), *case.arrays.values()])
    weights.clear()  # the caller's dict: the set's own is untouched
    assert dumps.weights()
