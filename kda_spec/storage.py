"""Writing a dump set so that a run never damages what is at its destination.

What may be there: nothing, an empty folder, or a dump set (a `manifest.json` of format `kda-dump`),
which is replaced only with `overwrite`. Anything else is refused.

- A local folder is built in a staging folder beside it (`.NAME.staging-PID`), read back and checked
  against the manifest, and swapped in by two renames (old aside, new in) only once complete; the old
  set is deleted after. A run that stops earlier removes its staging folder and leaves the old set as
  it was.
- A remote URL (`gs://`, `memory://`) has no atomic rename: the data files are written first, the
  manifest last, and only then are the files the new manifest does not name deleted. A run that stops
  earlier deletes what it wrote when there was no set before; over an old set it leaves the old
  manifest, whose checksums then show which files the run replaced.
"""

from __future__ import annotations

import abc
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from kda_spec.dump_format import CASES_DIR, FORMAT_NAME, MANIFEST_FILE, sha256_bytes
from kda_spec.remote import LocationError, open_location


class StorageError(ValueError):
    """A destination the user can fix: not writable, already holding a dump set, a file."""


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed npz of `arrays` in their order: the same arrays give the same bytes."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode()


def named_files(manifest: dict[str, Any]) -> dict[str, str]:
    """Every file a manifest names, with its sha256."""
    files = {manifest["weights"]["file"]: manifest["weights"]["sha256"]}
    files.update({case["file"]: case["sha256"] for case in manifest["cases"]})
    return files


def open_writer(url: str, *, overwrite: bool) -> DumpWriter:
    """The writer for `url`, once what is there allows the run (a StorageError says why not)."""
    try:
        fs, root = open_location(url)
    except LocationError as err:
        raise StorageError(f"--out {err}") from None
    if isinstance(fs, LocalFileSystem):
        return StagedFolderWriter(url, Path(root), overwrite=overwrite)
    return RemoteWriter(url, fs, root, overwrite=overwrite)


def check_destination(url: str, fs: fsspec.AbstractFileSystem, root: str, *, overwrite: bool) -> bool:
    """Whether `root` holds files: False when it is absent or empty, True for a dump set that `overwrite`
    allows to replace; a StorageError for anything else."""
    try:
        if not fs.exists(root):
            return False
        if not fs.isdir(root):
            raise StorageError(f"--out {url} is a file, not a folder")
        if not fs.ls(root, detail=False):
            return False
        manifest_path = f"{root.rstrip('/')}/{MANIFEST_FILE}"
        manifest = json.loads(fs.cat_file(manifest_path)) if fs.isfile(manifest_path) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StorageError(f"--out {url}: cannot tell what the folder holds: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StorageError(
            f"--out {url} is not empty and holds no dump set (no {FORMAT_NAME} {MANIFEST_FILE}); "
            "refusing to write into it: choose a new or empty folder"
        )
    if not overwrite:
        raise StorageError(f"--out {url} already holds a dump set; pass --overwrite to replace it")
    return True


class DumpWriter(abc.ABC):
    """The destination of one dump set: `write` each data file, then `commit` the manifest; `abort`
    undoes an unfinished run (safe to call at any time, and more than once). As a context manager it
    aborts when the block raises, KeyboardInterrupt included."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.abort()

    @abc.abstractmethod
    def write(self, relpath: str, data: bytes) -> str:
        """Write one data file of the set; returns its sha256."""

    @abc.abstractmethod
    def commit(self, manifest: dict[str, Any]) -> None:
        """Make the set with this manifest the one at the destination."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop what an unfinished run wrote, keeping what was there before."""


class StagedFolderWriter(DumpWriter):
    """A local folder, built beside the destination and swapped in when complete."""

    def __init__(self, url: str, destination: Path, *, overwrite: bool):
        super().__init__(url)
        self.destination = destination
        check_destination(url, LocalFileSystem(), str(destination), overwrite=overwrite)
        self.staging = destination.with_name(f".{destination.name}.staging-{os.getpid()}")
        try:
            shutil.rmtree(self.staging, ignore_errors=True)  # left by a killed run with our pid
            (self.staging / CASES_DIR).mkdir(parents=True)
        except OSError as err:
            raise StorageError(f"--out {url}: destination is not writable: {err}") from None

    def write(self, relpath: str, data: bytes) -> str:
        try:
            (self.staging / relpath).write_bytes(data)
        except OSError as err:
            raise StorageError(f"--out {self.url}: cannot write {relpath} in {self.staging}: {err}") from None
        return sha256_bytes(data)

    def commit(self, manifest: dict[str, Any]) -> None:
        self.write(MANIFEST_FILE, manifest_bytes(manifest))
        self._verify_staging(manifest)
        replaced = self.destination.with_name(f".{self.destination.name}.replaced-{os.getpid()}")
        had_old = self.destination.exists()
        try:
            if had_old:
                os.rename(self.destination, replaced)
            try:
                os.rename(self.staging, self.destination)
            except OSError:
                if had_old:
                    os.rename(replaced, self.destination)
                raise
        except OSError as err:
            raise StorageError(f"--out {self.url}: cannot move the new set into place: {err}") from None
        shutil.rmtree(replaced, ignore_errors=True)

    def _verify_staging(self, manifest: dict[str, Any]) -> None:
        """Read every file back: the staged set must be what the manifest says before it replaces anything."""
        for relpath, sha256 in named_files(manifest).items():
            path = self.staging / relpath
            found = sha256_bytes(path.read_bytes()) if path.is_file() else "no file"
            if found != sha256:
                raise StorageError(
                    f"--out {self.url}: staged {path} reads back as {found}, the manifest says {sha256}; "
                    "nothing was replaced"
                )

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


class RemoteWriter(DumpWriter):
    """An fsspec URL without atomic renames: data files first, the manifest last, stale files after."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str, *, overwrite: bool):
        super().__init__(url)
        self.fs, self.root = fs, root.rstrip("/")
        self.had_files = check_destination(url, fs, root, overwrite=overwrite)
        self.written: list[str] = []
        self.committed = False
        try:
            fs.makedirs(self._path(CASES_DIR), exist_ok=True)
        except OSError as err:
            raise StorageError(f"--out {url}: destination is not writable: {err}") from None

    def _path(self, relpath: str) -> str:
        return f"{self.root}/{relpath}"

    def write(self, relpath: str, data: bytes) -> str:
        try:
            self.fs.pipe_file(self._path(relpath), data)
        except OSError as err:
            raise StorageError(f"--out {self.url}: cannot write {relpath}: {err}") from None
        self.written.append(relpath)
        return sha256_bytes(data)

    def commit(self, manifest: dict[str, Any]) -> None:
        self.write(MANIFEST_FILE, manifest_bytes(manifest))
        self.committed = True
        keep = {self._path(relpath) for relpath in (MANIFEST_FILE, *named_files(manifest))}
        try:
            stale = [path for path in self.fs.find(self.root) if path.rstrip("/") not in keep]
            for path in stale:
                self.fs.rm_file(path)
        except OSError as err:
            raise StorageError(
                f"--out {self.url}: the new set is complete, but deleting a file it does not name failed: "
                f"{err}"
            ) from None

    def abort(self) -> None:
        if self.committed or self.had_files:
            return
        for relpath in self.written:
            try:
                self.fs.rm_file(self._path(relpath))
            except OSError:
                continue  # best effort: the run is failing already
