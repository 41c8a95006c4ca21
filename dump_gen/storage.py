"""Writing a dump set through fsspec (a local folder, `gs://bucket/prefix` through gcsfs, `memory://`).

A set is written so that a reader never trusts a half-written one: an old manifest is removed before
anything else is written, the data files follow, and the new manifest comes last, moved into place
from a temporary name. A run that stops midway leaves no manifest, and a reader refuses the set.
"""

from __future__ import annotations

import io
import json
from typing import Any

import fsspec
import numpy as np

from dump_gen.errors import DumpError
from kda_spec.dump_format import CASES_DIR, MANIFEST_FILE, sha256_bytes


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed npz of `arrays` in their order: the same arrays give the same bytes."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


class DumpWriter:
    """The destination of one dump set, opened (and its folders made) before any work is done."""

    def __init__(self, url: str):
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
            self.fs.makedirs(self._path(CASES_DIR), exist_ok=True)
        except ImportError as err:
            raise DumpError(
                f"--out {url}: {err} (for gs:// install the 'gcs' extra: pip install -e '.[gcs]')"
            ) from None
        except (ValueError, OSError) as err:
            raise DumpError(f"--out {url}: destination is not writable: {err}") from None

    def _path(self, relpath: str) -> str:
        return f"{self.root.rstrip('/')}/{relpath}"

    def begin(self) -> None:
        """Drop an old manifest, so that the set is invalid until `finish`."""
        try:
            if self.fs.exists(self._path(MANIFEST_FILE)):
                self.fs.rm(self._path(MANIFEST_FILE))
        except OSError as err:
            raise DumpError(f"--out {self.url}: cannot remove the old manifest: {err}") from None

    def write(self, relpath: str, data: bytes) -> str:
        """Write one file of the set; returns its sha256."""
        try:
            self.fs.pipe_file(self._path(relpath), data)
        except OSError as err:
            raise DumpError(f"--out {self.url}: cannot write {relpath}: {err}") from None
        return sha256_bytes(data)

    def finish(self, manifest: dict[str, Any]) -> None:
        """Write the manifest last, under a temporary name first."""
        temporary = f"{MANIFEST_FILE}.partial"
        self.write(temporary, (json.dumps(manifest, indent=2) + "\n").encode())
        try:
            self.fs.mv(self._path(temporary), self._path(MANIFEST_FILE))
        except OSError as err:
            raise DumpError(f"--out {self.url}: cannot move the manifest into place: {err}") from None
