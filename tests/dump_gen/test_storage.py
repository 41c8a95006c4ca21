"""A run never damages what is at --out: an existing set is replaced only with --overwrite (through a
staging folder for a local --out, manifest-last for a remote one), anything else is refused, and an
interrupted run leaves the previous set verifiable."""

from __future__ import annotations

import itertools
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import dump_gen.generate
from conformance.dumps.reader import DumpSet
from tests.dump_gen.conftest import TINY, dump

GOLDEN = Path(__file__).parents[2] / "golden"
REPO = Path(__file__).parents[2]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path, with its bytes."""
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "Traceback" not in "\n".join(lines)
    assert lines[-1].startswith("dump_gen: error: "), lines
    return lines[-1]


@pytest.fixture
def old_set(tmp_path: Path) -> Path:
    """A copy of golden/ (twelve cases) in a folder of its own."""
    root = tmp_path / "parent" / "set"
    shutil.copytree(GOLDEN, root)
    assert DumpSet(str(root)).verify() == []
    return root


def fail_on_second_case(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    calls = itertools.count()
    real_case_arrays = dump_gen.generate.case_arrays

    def failing(*args, **kwargs):
        if next(calls) == 1:
            raise error
        return real_case_arrays(*args, **kwargs)

    monkeypatch.setattr(dump_gen.generate, "case_arrays", failing)


def test_existing_set_is_refused_without_overwrite(old_set: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(old_set.parent)
    assert dump(old_set, cases=["T1"]) == 2
    assert f"--out {old_set} already holds a dump set; pass --overwrite" in one_error_line(capsys)
    assert tree(old_set.parent) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_folder_that_is_not_a_dump_set_is_refused(
    overwrite: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mine"
    (folder / "cases").mkdir(parents=True)
    (folder / "manifest.json").write_text('{"format": "something-else"}')
    (folder / "weights.npz").write_bytes(b"not ours")
    before = tree(tmp_path)
    assert dump(folder, *overwrite, cases=["T1"]) == 2
    assert "holds no dump set" in one_error_line(capsys)
    assert tree(tmp_path) == before


def test_file_as_destination_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me")
    assert dump(target, "--overwrite", cases=["T1"]) == 2
    assert "is a file, not a folder" in one_error_line(capsys)
    assert target.read_text() == "keep me"


@pytest.mark.torch
def test_overwrite_leaves_a_consistent_one_case_set(old_set: Path) -> None:
    assert dump(old_set, "--overwrite", cases=["T1"]) == 0
    assert sorted(tree(old_set)) == ["cases/T1.npz", "manifest.json", "weights.npz"]
    assert DumpSet(str(old_set)).verify() == []
    assert list(old_set.parent.iterdir()) == [old_set]  # no staging or replaced folder left


@pytest.mark.torch
@pytest.mark.parametrize(("error", "status"), [(KeyboardInterrupt(), 130), (RuntimeError("injected"), None)])
def test_interrupted_run_leaves_the_old_set(
    error: BaseException, status: int | None, old_set: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = tree(old_set.parent)
    fail_on_second_case(monkeypatch, error)
    if status is None:
        with pytest.raises(type(error)):
            dump(old_set, "--overwrite", cases=["T1", "T8"])
    else:
        assert dump(old_set, "--overwrite", cases=["T1", "T8"]) == status
    assert tree(old_set.parent) == before
    assert DumpSet(str(old_set)).verify() == []


SLOW_SECOND_CASE = """
import faulthandler, itertools, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, should it not stop on SIGINT
import dump_gen.generate as generate
real, calls = generate.case_arrays, itertools.count()
def slow(*args, **kwargs):
    if next(calls) == 1:
        print("second case", flush=True)
        # Short sleeps, as a real case's work returns to Python often: SIGINT may land on another of the
        # process's threads (tqdm's monitor, torch's), and then the main thread sees it only between
        # bytecodes, not inside one long sleep.
        for _ in range(6000):
            time.sleep(0.1)
    return real(*args, **kwargs)
generate.case_arrays = slow
from dump_gen.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.torch
def test_sigint_leaves_the_old_set(old_set: Path) -> None:
    before = tree(old_set.parent)
    argv = ["--out", str(old_set), *TINY, "--overwrite", "--cases", "T1", "T8"]
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_SECOND_CASE, *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "second case"
        assert any(path.name.startswith(".set.staging-") for path in old_set.parent.iterdir())
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            time.sleep(2)
            process.kill()
            threads = process.communicate()[1]
            pytest.fail(f"dump_gen did not stop within 120 s of SIGINT; its threads:\n{threads}")
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("dump_gen: interrupted")
    assert tree(old_set.parent) == before
    assert DumpSet(str(old_set)).verify() == []


# --------------------------------------------------------------------------------------- remote URLs


@pytest.fixture
def memory_set(request: pytest.FixtureRequest) -> str:
    """golden/ copied to a memory:// URL of this test's own."""
    url = f"memory://dump_gen-storage/{request.node.name}"
    fs, root = fsspec.core.url_to_fs(url)
    for relpath, data in tree(GOLDEN).items():
        fs.pipe_file(f"{root}/{relpath}", data)
    yield url
    fs.rm(root, recursive=True)


def memory_tree(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {path[len(root) + 1 :]: fs.cat_file(path) for path in fs.find(root)}


def test_remote_set_is_refused_without_overwrite(memory_set: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = memory_tree(memory_set)
    assert dump(memory_set, cases=["T1"]) == 2
    assert "already holds a dump set" in one_error_line(capsys)
    assert memory_tree(memory_set) == before


@pytest.mark.torch
def test_remote_overwrite_writes_the_manifest_last_then_deletes_stale_files(
    memory_set: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    operations: list[tuple[str, str]] = []
    real_pipe, real_rm = MemoryFileSystem.pipe_file, MemoryFileSystem.rm_file

    def pipe_file(self, path, value, *args, **kwargs):
        operations.append(("write", path.rsplit("/", 2)[-1]))
        return real_pipe(self, path, value, *args, **kwargs)

    def rm_file(self, path):
        operations.append(("delete", path.rsplit("/", 2)[-1]))
        return real_rm(self, path)

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", pipe_file)
    monkeypatch.setattr(MemoryFileSystem, "rm_file", rm_file)
    assert dump(memory_set, "--overwrite", cases=["T1", "T8"]) == 0
    manifest_at = operations.index(("write", "manifest.json"))
    assert {op for op, _ in operations[:manifest_at]} == {"write"}
    assert {name for _, name in operations[:manifest_at]} == {"weights.npz", "T1.npz", "T8.npz"}
    deleted = [name for op, name in operations[manifest_at + 1 :]]
    assert {op for op, _ in operations[manifest_at + 1 :]} == {"delete"}
    assert len(deleted) == 10 + 1  # ten stale cases and golden's README.md
    assert sorted(memory_tree(memory_set)) == ["cases/T1.npz", "cases/T8.npz", "manifest.json", "weights.npz"]
    assert DumpSet(memory_set).verify() == []


@pytest.mark.torch
def test_remote_interrupted_run(memory_set: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over an old set the old manifest stays, and only the files the run had written differ (remote
    stores cannot rename a set into place); into a fresh location, nothing is left."""
    fail_on_second_case(monkeypatch, KeyboardInterrupt())
    before = memory_tree(memory_set)
    assert dump(memory_set, "--overwrite", cases=["T1", "T8"]) == 130
    after = memory_tree(memory_set)
    assert after.keys() == before.keys() and after["manifest.json"] == before["manifest.json"]
    assert {name for name in before if after[name] != before[name]} <= {"weights.npz", "cases/T1.npz"}

    fail_on_second_case(monkeypatch, KeyboardInterrupt())
    fresh = memory_set + "-fresh"
    assert dump(fresh, cases=["T1", "T8"]) == 130
    assert memory_tree(fresh) == {}
