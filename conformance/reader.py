"""Reading a dump set (format v1) from a folder or an fsspec URL, checking everything before use.

The format is docs/dump-format.md (names and shapes in `dump_format`). Nothing here trusts a file
whose sha256 differs from the manifest; every problem is a `DumpError` that names the file, the key
and what was expected against what was found.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import posixpath
import zipfile
from typing import Any

import fsspec
import numpy as np

from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig

# Result names a case file may hold (without the `_bf16` suffix); `out` is stored as out_fp32/out_bf16.
_RESULT_NAMES = (*fmt.KERNEL_KEYS, *fmt.INTERMEDIATE_KEYS, *fmt.OPTIONAL_KEYS)
_REQUIRED_CASE_FIELDS = ("id", "file", "sha256", "seq_lens")


class DumpError(Exception):
    """A dump set that cannot be used as it is; the message says where and what."""


@dataclasses.dataclass(frozen=True)
class CaseInfo:
    """One case as the manifest describes it."""

    case_id: str
    file: str
    sha256: str
    seq_lens: tuple[int, ...]
    initial_state: bool
    layer_kernel_path: str
    keys: tuple[str, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int32)


@dataclasses.dataclass
class CaseData:
    """The arrays of one case, checked and decoded: floats as float32 (bf16 bits widened exactly)."""

    info: CaseInfo
    arrays: dict[str, np.ndarray]

    @property
    def hidden_states(self) -> np.ndarray:
        return self.arrays["hidden_states"]

    @property
    def cu_seqlens(self) -> np.ndarray:
        return self.arrays["cu_seqlens"]

    @property
    def initial_state(self) -> np.ndarray | None:
        return self.arrays.get("initial_recurrent_state")

    def result(self, name: str, dtype: str) -> np.ndarray | None:
        """Result `name` ("out", "o_kda_chunk", "g", ...) of the `dtype` run, or None when not dumped."""
        return self.arrays.get(fmt.result_key(name, dtype))

    def has_dtype(self, dtype: str) -> bool:
        return fmt.result_key(fmt.OUTPUT_KEY, dtype) in self.arrays


def split_key(key: str) -> tuple[str, str] | None:
    """(result name, dtype) of a stored result key, or None for inputs and keys this reader does not know."""
    for dtype in fmt.DTYPES:
        if key == fmt.result_key(fmt.OUTPUT_KEY, dtype):
            return fmt.OUTPUT_KEY, dtype
    if key.endswith("_bf16") and key[: -len("_bf16")] in _RESULT_NAMES:
        return key[: -len("_bf16")], "bf16"
    if key in _RESULT_NAMES:
        return key, "fp32"
    return None


class DumpSet:
    """A dump set at a local path or fsspec URL (`gs://…` needs gcsfs).

    Opening reads and checks the manifest only; `weights()` and `case()` check each file's sha256,
    keys, dtypes and shapes when they read it; `verify()` does all of it for every file.
    """

    def __init__(self, url: str):
        self.url = url
        self._fs, self._root = _open_filesystem(url)
        manifest_bytes = self._read(fmt.MANIFEST_FILE)
        try:
            manifest = json.loads(manifest_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DumpError(f"{self._where(fmt.MANIFEST_FILE)}: not valid JSON ({err})") from None
        self.manifest: dict[str, Any] = _check_header(manifest, self._where(fmt.MANIFEST_FILE))
        try:
            self.config = KDAConfig.from_manifest(manifest.get("config") or {})
        except ValueError as err:
            raise DumpError(f"{self._where(fmt.MANIFEST_FILE)}: {err}") from None
        self.cases: dict[str, CaseInfo] = _parse_cases(manifest, self._where(fmt.MANIFEST_FILE))

    # ------------------------------------------------------------------------------------------- files

    def _where(self, relpath: str) -> str:
        return f"{self.url.rstrip('/')}/{relpath}"

    def _read(self, relpath: str) -> bytes:
        path = posixpath.join(self._root, relpath)
        try:
            return self._fs.cat_file(path)
        except FileNotFoundError:
            if relpath == fmt.MANIFEST_FILE:
                if not self._fs.exists(self._root):
                    raise DumpError(f"{self.url}: no such dump set (the folder does not exist)") from None
                raise DumpError(
                    f"{self._where(relpath)}: missing: not a dump set, or an incomplete one"
                ) from None
            raise DumpError(f"{self._where(relpath)}: file missing") from None
        except OSError as err:
            raise DumpError(f"{self._where(relpath)}: cannot read ({err})") from None

    def _read_verified_npz(self, relpath: str, sha256: str) -> dict[str, np.ndarray]:
        data = self._read(relpath)
        found = fmt.sha256_bytes(data)
        if found != sha256:
            raise DumpError(
                f"{self._where(relpath)}: sha256 mismatch: manifest expects {sha256}, file has {found}"
            )
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                return {key: npz[key] for key in npz.files}
        except (ValueError, OSError, zipfile.BadZipFile) as err:
            raise DumpError(f"{self._where(relpath)}: not a readable .npz file ({err})") from None

    # ------------------------------------------------------------------------------------------ content

    def weights(self) -> dict[str, np.ndarray]:
        """The float32 weights by HF name, after checking checksum, names, dtypes and shapes."""
        block = self.manifest.get("weights") or {}
        relpath = block.get("file", fmt.WEIGHTS_FILE)
        where = self._where(relpath)
        if "sha256" not in block:
            raise DumpError(f"{self._where(fmt.MANIFEST_FILE)}: 'weights' block has no 'sha256'")
        arrays = self._read_verified_npz(relpath, block["sha256"])
        expected = fmt.weight_shapes(self.config.to_manifest())
        missing = sorted(set(expected) - set(arrays))
        if missing:
            raise DumpError(f"{where}: missing weight key(s) {missing}; found {sorted(arrays)}")
        for name, shape in expected.items():
            array = arrays[name]
            if array.dtype != np.float32:
                raise DumpError(f"{where}: key {name!r}: expected dtype float32, found {array.dtype}")
            if array.shape != shape:
                raise DumpError(f"{where}: key {name!r}: expected shape {shape}, found {array.shape}")
        return {name: arrays[name] for name in expected}

    def case(self, case_id: str) -> CaseData:
        """The checked and decoded arrays of `case_id`."""
        if case_id not in self.cases:
            raise DumpError(f"{self.url}: no case {case_id!r}; the manifest lists {list(self.cases)}")
        info = self.cases[case_id]
        raw = self._read_verified_npz(info.file, info.sha256)
        return CaseData(info, _check_case_arrays(info, raw, self.config, self._where(info.file)))

    def verify(self) -> list[str]:
        """Check every file of the set; the list of problems found (empty when the set is sound)."""
        problems = []
        checks = [self.weights, *(functools.partial(self.case, case_id) for case_id in self.cases)]
        for check in checks:
            try:
                check()
            except DumpError as err:
                problems.append(str(err))
        return problems

    def case_ids(self, selected: list[str] | None = None) -> list[str]:
        """The manifest's cases in order, or the `selected` ones (a DumpError names unknown ids)."""
        if not selected:
            return list(self.cases)
        unknown = [case_id for case_id in selected if case_id not in self.cases]
        if unknown:
            raise DumpError(f"{self.url}: no case(s) {unknown}; the manifest lists {list(self.cases)}")
        return list(selected)


def _open_filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of `url`; a remote set is cached locally so each file is fetched once."""
    is_remote = "://" in url and not url.startswith(("file://", "memory://", "simplecache::"))
    try:
        return fsspec.core.url_to_fs(f"simplecache::{url}" if is_remote else url)
    except ImportError as err:
        raise DumpError(f"{url}: cannot open ({err}); for gs:// install gcsfs (pip install gcsfs)") from None
    except ValueError as err:
        raise DumpError(f"{url}: cannot open ({err})") from None


def _check_header(manifest: Any, where: str) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise DumpError(f"{where}: expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format") != fmt.FORMAT_NAME:
        raise DumpError(f"{where}: 'format' must be {fmt.FORMAT_NAME!r}, found {manifest.get('format')!r}")
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DumpError(f"{where}: 'version' must be an integer, found {version!r}")
    if version != fmt.FORMAT_VERSION:
        raise DumpError(
            f"{where}: unknown format version {version}; this reader knows version {fmt.FORMAT_VERSION}"
        )
    return manifest


def _parse_cases(manifest: dict[str, Any], where: str) -> dict[str, CaseInfo]:
    entries = manifest.get("cases")
    if not isinstance(entries, list) or not entries:
        raise DumpError(f"{where}: 'cases' must be a non-empty list, found {entries!r}")
    cases: dict[str, CaseInfo] = {}
    for index, entry in enumerate(entries):
        label = f"{where}: cases[{index}]"
        if not isinstance(entry, dict):
            raise DumpError(f"{label}: expected an object, found {entry!r}")
        missing = [field for field in _REQUIRED_CASE_FIELDS if field not in entry]
        if missing:
            raise DumpError(f"{label}: missing field(s) {missing}")
        file = str(entry["file"])
        if file.startswith("/") or ".." in file.split("/"):
            raise DumpError(f"{label}: 'file' must be a path inside the set, found {file!r}")
        seq_lens = tuple(entry["seq_lens"])
        if not seq_lens or not all(isinstance(n, int) and n > 0 for n in seq_lens):
            raise DumpError(f"{label}: 'seq_lens' must be positive integers, found {entry['seq_lens']!r}")
        info = CaseInfo(
            case_id=str(entry["id"]),
            file=file,
            sha256=str(entry["sha256"]),
            seq_lens=seq_lens,
            initial_state=bool(entry.get("initial_state", False)),
            layer_kernel_path=str(entry.get("layer_kernel_path", "chunk")),
            keys=tuple(entry.get("keys", ())),
        )
        if info.case_id in cases:
            raise DumpError(f"{label}: case id {info.case_id!r} appears twice")
        cases[info.case_id] = info
    return cases


def _check_case_arrays(
    info: CaseInfo, raw: dict[str, np.ndarray], config: KDAConfig, where: str
) -> dict[str, np.ndarray]:
    """Check keys, dtypes, shapes and offsets of one case file and decode it."""
    if info.keys:
        missing = [key for key in info.keys if key not in raw]
        if missing:
            raise DumpError(
                f"{where}: key(s) {missing} listed in the manifest are missing; found {sorted(raw)}"
            )
    if "hidden_states" not in raw:
        raise DumpError(f"{where}: missing key 'hidden_states'")
    if info.initial_state and "initial_recurrent_state" not in raw:
        raise DumpError(f"{where}: missing key 'initial_recurrent_state' (the manifest says initial_state)")
    tokens, num_seqs = info.total_tokens, len(info.seq_lens)
    block = config.to_manifest()
    arrays: dict[str, np.ndarray] = {}
    for key, array in raw.items():
        parsed = split_key(key)
        if parsed is None and key not in fmt.INPUT_KEYS:
            continue  # a key a newer writer added; not ours to judge
        name, dtype = parsed if parsed else (key, "fp32")
        if key == "cu_seqlens":
            if array.dtype.kind not in "iu":
                raise DumpError(f"{where}: key 'cu_seqlens': expected dtype int32, found {array.dtype}")
            expected_offsets = info.cu_seqlens
            if array.shape != expected_offsets.shape or not np.array_equal(array, expected_offsets):
                raise DumpError(
                    f"{where}: key 'cu_seqlens': expected {expected_offsets.tolist()} "
                    f"(from seq_lens {list(info.seq_lens)}), found {array.tolist()}"
                )
            arrays[key] = array.astype(np.int32)
            continue
        allowed = (
            (np.float32, np.uint16) if dtype == "bf16" and name not in fmt.FP32_IN_BF16_RUN else (np.float32,)
        )
        if array.dtype not in allowed:
            expected_dtypes = " or ".join(np.dtype(d).name for d in allowed)
            raise DumpError(f"{where}: key {key!r}: expected dtype {expected_dtypes}, found {array.dtype}")
        shape = fmt.expected_shape(name, tokens=tokens, num_seqs=num_seqs, config=block)
        if array.shape != shape:
            raise DumpError(f"{where}: key {key!r}: expected shape {shape}, found {array.shape}")
        arrays[key] = fmt.decode_array(array)
    arrays.setdefault("cu_seqlens", info.cu_seqlens)
    return arrays
