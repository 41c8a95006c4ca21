"""Property: whatever happens to a dump set, `verify` says ok only when what it reads is what was
written, and otherwise exits 2 with one `error:` line (the problems listed below it): never a
traceback, never exit 1.

A small valid set is mutated at random: bytes flipped in any file, npz members dropped, renamed,
retyped or reshaped, manifest fields deleted or given values of other types. A mutation that also
rewrites the manifest's sha256 of the file it changed makes a consistent set with other data, which
`verify` may accept; for those only the exit path is asserted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.cli import main
from conformance.dumps.reader import DumpSet
from kda_spec import dump_format as fmt
from tests.conformance.synthetic import write_dump_set

CASE = "T8"
FILES = (fmt.MANIFEST_FILE, fmt.WEIGHTS_FILE, f"{fmt.CASES_DIR}/{CASE}.npz")
NPZ_FILES = FILES[1:]
DTYPES = (np.float64, np.float32, np.float16, np.int64, np.int32, np.uint16, np.uint8, np.bool_)


@dataclasses.dataclass(frozen=True)
class Contents:
    """What a sound set holds: the data `verify` vouches for."""

    weights: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]
    seq_lens: tuple[int, ...]
    initial_state: bool


def _contents(root: Path) -> Contents:
    dumps = DumpSet(str(root))
    case = dumps.case(CASE)
    return Contents(dumps.weights(), case.arrays, case.info.seq_lens, case.info.initial_state)


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Contents]:
    root = write_dump_set(tmp_path_factory.mktemp("fuzz"), (CASE,), intermediates=False)
    return root, _contents(root)


def _manifest_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a field or list item of the manifest."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    paths = []
    for key, value in items:
        paths.append((*prefix, key))
        paths += _manifest_paths(value, (*prefix, key))
    return paths


def _npz_members(path: Path) -> list[str]:
    with np.load(path) as npz:
        return list(npz.files)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def mutations(draw: st.DrawFn, manifest: dict[str, Any], members: dict[str, list[str]]) -> tuple:
    kind = draw(st.sampled_from(["flip", "npz", "manifest"]))
    if kind == "flip":
        return ("flip", draw(st.sampled_from(FILES)), draw(st.floats(0, 1)), draw(st.integers(1, 255)))
    if kind == "npz":
        file = draw(st.sampled_from(NPZ_FILES))
        member = draw(st.sampled_from(members[file]))
        op = draw(st.sampled_from(["drop", "rename", "retype", "reshape"]))
        argument: Any = None
        if op == "rename":
            argument = draw(st.sampled_from([*members[file], "renamed", "out_bf16", "cu_seqlens"]))
        elif op == "retype":
            argument = draw(st.sampled_from(DTYPES))
        elif op == "reshape":
            argument = draw(st.sampled_from(["flat", "lead", "trail", "transpose"]))
        return ("npz", file, member, op, argument, draw(st.booleans()))
    path = draw(st.sampled_from(_manifest_paths(manifest)))
    return ("manifest", path, draw(st.sampled_from(["delete", "replace"])), draw(json_values))


def _container(manifest: Any, path: tuple) -> Any:
    """The dict or list that holds `path`'s last key, or None where an earlier change removed it."""
    node = manifest
    for key in path:
        if not (isinstance(node, dict) and key in node) and not (
            isinstance(node, list) and isinstance(key, int) and key < len(node)
        ):
            return None
        parent, node = node, node[key]
    return parent


def _apply(root: Path, mutation: tuple) -> bool:
    """Apply one mutation to the set at `root`; whether it rewrote a checksum to match."""
    kind, *rest = mutation
    if kind == "flip":
        file, where, xor = rest
        data = bytearray((root / file).read_bytes())
        data[min(int(where * len(data)), len(data) - 1)] ^= xor
        (root / file).write_bytes(bytes(data))
        return False
    manifest = json.loads((root / fmt.MANIFEST_FILE).read_text())
    if kind == "manifest":
        path, op, value = rest
        parent = _container(manifest, path)
        if parent is None:
            return False  # an earlier change removed it
        if op == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
        return False
    file, member, op, argument, rehash = rest
    with np.load(root / file) as npz:
        arrays = dict(npz)
    if member not in arrays:
        return False  # an earlier change removed it
    array = arrays.pop(member)
    if op == "rename":
        arrays[argument] = array
    elif op == "retype":
        arrays[member] = array.astype(argument)
    elif op == "reshape":
        shapes = {"flat": (-1,), "lead": (1, *array.shape), "trail": (*array.shape, 1)}
        arrays[member] = array.T if argument == "transpose" else array.reshape(shapes[argument])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (root / file).write_bytes(buffer.getvalue())
    if rehash:
        path = ("weights",) if file == fmt.WEIGHTS_FILE else ("cases", 0)
        parent = _container(manifest, path)
        block = None if parent is None else parent[path[-1]]
        if not isinstance(block, dict):
            return False  # an earlier change removed the block that holds the file's checksum
        block["sha256"] = fmt.sha256_bytes(buffer.getvalue())
        (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    return rehash


def _verify(root: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", "--dumps", str(root)])
    return code, err.getvalue()


def _assert_refused_in_one_line(code: int, err: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert lines and lines[0].startswith("error: "), err
    assert all(line.startswith("  ") for line in lines[1:]), err
    assert "Traceback" not in err


def test_verify_holds_its_exit_paths_on_any_mutation(base: tuple[Path, Contents]) -> None:
    root, original = base
    manifest = json.loads((root / fmt.MANIFEST_FILE).read_text())
    members = {file: _npz_members(root / file) for file in NPZ_FILES}
    assert _verify(root) == (0, "")

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(mutations(manifest, members), min_size=1, max_size=2))
    def check(changes: list[tuple]) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            mutated = Path(shutil.copytree(root, Path(scratch) / "set"))
            # Byte flips last: the other changes edit the manifest and the npz files as JSON and zip.
            ordered = sorted(changes, key=lambda change: change[0] == "flip")
            rehashed = [_apply(mutated, change) for change in ordered]
            code, err = _verify(mutated)
            if code == 0:
                assert err == ""
                if not any(rehashed):  # the set was damaged, not rewritten: ok means unchanged data
                    now = _contents(mutated)
                    assert _same(now.weights, original.weights) and _same(now.arrays, original.arrays)
                    assert (now.seq_lens, now.initial_state) == (original.seq_lens, original.initial_state)
            else:
                _assert_refused_in_one_line(code, err)

    check()


@pytest.mark.parametrize(
    "damage",
    ["hidden_size null", "a 2**50-element header"],
)
def test_run_refuses_a_damaged_set_in_one_line(
    base: tuple[Path, Contents], tmp_path: Path, capsys: pytest.CaptureFixture, damage: str
) -> None:
    root = Path(shutil.copytree(base[0], tmp_path / "set"))
    if damage == "hidden_size null":
        manifest = json.loads((root / fmt.MANIFEST_FILE).read_text())
        manifest["config"]["hidden_size"] = None
        (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
        expected = "config.hidden_size must be an integer, found None"
    else:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f4", "fortran_order": False, "shape": (2**50,)}
        )
        case_file = root / FILES[2]
        buffer = io.BytesIO(case_file.read_bytes())
        with zipfile.ZipFile(buffer, "a") as archive:
            archive.writestr("huge.npy", header.getvalue())
        case_file.write_bytes(buffer.getvalue())
        manifest = json.loads((root / fmt.MANIFEST_FILE).read_text())
        manifest["cases"][0]["sha256"] = fmt.sha256_bytes(buffer.getvalue())
        (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
        expected = "member 'huge.npy': header declares shape (1125899906842624,) of float32"
    reports = tmp_path / "reports"
    code = main(["run", "--dumps", str(root), "--dtypes", "fp32", "--report-dir", str(reports)])
    captured = capsys.readouterr()
    _assert_refused_in_one_line(code, captured.err)
    assert expected in captured.err
    assert list(reports.iterdir()) == []
