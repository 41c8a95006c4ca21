"""Reading a dump set (format v1) from a folder or an fsspec URL, checking everything before use.

The format is docs/dump-format.md (names and shapes in `dump_format`). Nothing here trusts a file
whose sha256 differs from the manifest; every problem is a `DumpError` that names the file, the key
and what was expected against what was found.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import posixpath
import re
from collections.abc import Iterable
from typing import Any

import fsspec
import numpy as np

from conformance.dumps.bundled import dump_set_label
from conformance.dumps.reference_precision import PrecisionBlockError, reference_precision
from conformance.dumps.safe_npz import NpzError, load_npz
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.remote import LocationError, open_location

# Result names a case file may hold (without the `_bf16` suffix); `out` is stored as out_fp32/out_bf16.
_RESULT_NAMES = (
    *fmt.KERNEL_KEYS, *fmt.INTERMEDIATE_KEYS, *fmt.OPTIONAL_INTERMEDIATE_KEYS, *fmt.OPTIONAL_KEYS,
    *fmt.GRADIENT_RESULT_KEYS,
)  # fmt: skip
# Decoded cases a DumpSet keeps after reading them (the most recent first), so that a run reads and
# checks each file once; a larger set reads a case again (and checks it again) when it comes back to it.
CASE_CACHE_BYTES = 1 << 30
_REQUIRED_CASE_FIELDS = ("id", "file", "sha256", "seq_lens")
_CONFIG_INT_FIELDS = ("hidden_size", "num_heads", "head_dim", "conv_size")
_LAYER_KERNEL_PATHS = ("chunk", "fused_recurrent")
# Where a dump set comes from, for a --dumps that names none.
WHERE_SETS_COME_FROM = (
    "leave --dumps out for the golden set the package carries; a dump set is made by "
    "`python -m dump_gen --out DIR`, or read from the gs:// URL it was written to"
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    group: str | None = None  # an optional case group ("long"), None for the standard cases
    decode_steps: int = 0  # tokens the checker decodes one by one after prefilling the rest (0: none)

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
    keys, dtypes and shapes when they read it; `verify()` does all of it for every file. Each file is
    read and checked once: the weights are kept, and the cases read last up to `CASE_CACHE_BYTES`
    (a run's `verify()` then its checks read every file once). What they return is read-only.
    """

    def __init__(self, url: str):
        self.url = url
        self._fs, self._root = _open_filesystem(url)
        manifest_bytes = self._read(fmt.MANIFEST_FILE)
        where = self._where(fmt.MANIFEST_FILE)
        try:
            manifest = json.loads(manifest_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise DumpError(f"{where}: not valid JSON ({err})") from None
        # The manifest's own sha256: reports record it, so that the gate compares like with like.
        self.manifest_sha256 = fmt.sha256_bytes(manifest_bytes)
        self.manifest: dict[str, Any] = _check_header(manifest, where)
        self.config = _parse_config(manifest.get("config"), where)
        self.weights_file, self.weights_sha256 = _parse_weights_block(manifest.get("weights"), where)
        self.cases: dict[str, CaseInfo] = _parse_cases(manifest, where)
        try:  # whether its fp32 reference is IEEE fp32 (conformance/dumps/reference_precision.py)
            self.reference_precision = reference_precision(manifest, where)
        except PrecisionBlockError as err:
            raise DumpError(str(err)) from None
        self._weights: dict[str, np.ndarray] | None = None
        self._cases_read: collections.OrderedDict[str, CaseData] = collections.OrderedDict()

    @property
    def label(self) -> str:
        """The set as reports name it: `golden (bundled, manifest sha256 …)`, or its URL and digest."""
        return dump_set_label(self.url, self.manifest_sha256)

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
                    raise DumpError(
                        f"{self.url}: no such dump set (the folder does not exist); {WHERE_SETS_COME_FROM}"
                    ) from None
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
            return load_npz(data)
        except NpzError as err:
            raise DumpError(f"{self._where(relpath)}: {err}") from None

    # ------------------------------------------------------------------------------------------ content

    def weights(self) -> dict[str, np.ndarray]:
        """The float32 weights by HF name, after checking checksum, names, dtypes and shapes (read once)."""
        if self._weights is None:
            self._weights = _read_only(self._read_weights())
        return dict(self._weights)  # the caller's own dict of the kept (read-only) arrays

    def _read_weights(self) -> dict[str, np.ndarray]:
        relpath = self.weights_file
        where = self._where(relpath)
        arrays = self._read_verified_npz(relpath, self.weights_sha256)
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
        if case_id in self._cases_read:
            self._cases_read.move_to_end(case_id)
            return self._cases_read[case_id]
        info = self.cases[case_id]
        raw = self._read_verified_npz(info.file, info.sha256)
        case = CaseData(info, _read_only(_check_case_arrays(info, raw, self.config, self._where(info.file))))
        self._cases_read[case_id] = case
        while _nbytes(self._cases_read.values()) > CASE_CACHE_BYTES and len(self._cases_read) > 1:
            self._cases_read.popitem(last=False)
        return case

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


def open_verified(url: str) -> DumpSet:
    """The dump set at `url` with every file checked (its files are then read once by a run); a
    DumpError lists every problem, one an indented line."""
    dumps = DumpSet(url)
    problems = dumps.verify()
    if problems:
        raise DumpError(f"dump set {url} is broken:\n  " + "\n  ".join(problems))
    return dumps


def _read_only(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def _nbytes(cases: Iterable[CaseData]) -> int:
    return sum(array.nbytes for case in cases for array in case.arrays.values())


def _open_filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of `url`; a remote set is cached locally so each file is fetched once.
    An unreachable `gs://` host is reported within seconds, on one line (`kda_spec.remote`)."""
    try:
        return open_location(url, cached=True)
    except LocationError as err:
        raise DumpError(str(err)) from None


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_config(block: Any, where: str) -> KDAConfig:
    """The manifest's `config` block, every field of the right type, as a KDAConfig."""
    if not isinstance(block, dict):
        raise DumpError(f"{where}: 'config' must be an object, found {block!r}")
    for field in _CONFIG_INT_FIELDS:
        if field in block and not _is_int(block[field]):
            raise DumpError(f"{where}: config.{field} must be an integer, found {block[field]!r}")
    eps = block.get("rms_norm_eps", 1.0)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps)):
        raise DumpError(f"{where}: config.rms_norm_eps must be a finite number, found {eps!r}")
    if not isinstance(block.get("preset", ""), str):
        raise DumpError(f"{where}: config.preset must be a string, found {block['preset']!r}")
    try:
        return KDAConfig.from_manifest(block)
    except ValueError as err:
        raise DumpError(f"{where}: {err}") from None


def _relative_path(value: Any, label: str) -> str:
    """`value` if it is a relative POSIX path that stays inside the set, else a DumpError naming it."""
    if not isinstance(value, str) or not value:
        raise DumpError(f"{label} must be a non-empty string, found {value!r}")
    if not value.isprintable():  # a control character would break the message's line, and names no file
        raise DumpError(f"{label} must be a file name of printable characters, found {value!r}")
    parts = value.split("/")
    if value.startswith("/") or "\\" in value or ":" in value or any(p in ("", ".", "..") for p in parts):
        raise DumpError(
            f"{label} must be a relative path inside the set (no leading '/', '..', '\\', drive "
            f"letter or URL scheme), found {value!r}"
        )
    return value


def _sha256(value: Any, label: str) -> str:
    if not (isinstance(value, str) and _SHA256.fullmatch(value)):
        raise DumpError(f"{label} must be a sha256 (64 lowercase hex digits), found {value!r}")
    return value


def _parse_weights_block(block: Any, where: str) -> tuple[str, str]:
    """(file, sha256) of the manifest's `weights` block."""
    if not isinstance(block, dict):
        raise DumpError(f"{where}: 'weights' must be an object, found {block!r}")
    if "sha256" not in block:
        raise DumpError(f"{where}: 'weights' block has no 'sha256'")
    relpath = _relative_path(block.get("file", fmt.WEIGHTS_FILE), f"{where}: weights.file")
    return relpath, _sha256(block["sha256"], f"{where}: weights.sha256")


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
        case_id = entry["id"]
        if not isinstance(case_id, str) or not case_id:
            raise DumpError(f"{label}: 'id' must be a non-empty string, found {case_id!r}")
        seq_lens = entry["seq_lens"]
        if not (isinstance(seq_lens, list) and seq_lens and all(_is_int(n) and n > 0 for n in seq_lens)):
            raise DumpError(f"{label}: 'seq_lens' must be a list of positive integers, found {seq_lens!r}")
        initial_state = entry.get("initial_state", False)
        if not isinstance(initial_state, bool):
            raise DumpError(f"{label}: 'initial_state' must be true or false, found {initial_state!r}")
        kernel_path = entry.get("layer_kernel_path", "chunk")
        if kernel_path not in _LAYER_KERNEL_PATHS:
            raise DumpError(
                f"{label}: 'layer_kernel_path' must be one of {list(_LAYER_KERNEL_PATHS)}, "
                f"found {kernel_path!r}"
            )
        keys = entry.get("keys", [])
        if not (isinstance(keys, list) and all(isinstance(key, str) for key in keys)):
            raise DumpError(f"{label}: 'keys' must be a list of strings, found {keys!r}")
        group = entry.get("group")
        if group is not None and not (isinstance(group, str) and group):
            raise DumpError(f"{label}: 'group' must be a non-empty string, found {group!r}")
        decode_steps = entry.get("decode_steps", 0)
        if not (_is_int(decode_steps) and 0 <= decode_steps < min(seq_lens)):
            raise DumpError(
                f"{label}: 'decode_steps' must be an integer from 0 to the shortest sequence's length - 1 "
                f"({min(seq_lens) - 1}), found {decode_steps!r}"
            )
        relpath = _relative_path(entry["file"], f"{label}: 'file'")
        # The format names a case's file after its id: a manifest whose id and file disagree (a renamed
        # case, a flipped byte) would serve one case's arrays under another case's name.
        expected_file = fmt.case_file(case_id)
        if relpath != expected_file:
            raise DumpError(
                f"{label}: case {case_id!r} must be in {expected_file!r}, the manifest says {entry['file']!r}"
            )
        info = CaseInfo(
            case_id=case_id,
            file=relpath,
            sha256=_sha256(entry["sha256"], f"{label}: 'sha256'"),
            seq_lens=tuple(seq_lens),
            initial_state=initial_state,
            layer_kernel_path=kernel_path,
            keys=tuple(keys),
            group=group,
            decode_steps=decode_steps,
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
        truth = fmt.split_truth_key(key)
        if truth is not None:  # a float64 truth (conformance/checks/truth.py), kept in float64
            if array.dtype != np.float64:
                raise DumpError(f"{where}: key {key!r}: expected dtype float64, found {array.dtype}")
            shape = fmt.expected_shape(truth[0], tokens=tokens, num_seqs=num_seqs, config=block)
            if array.shape != shape:
                raise DumpError(f"{where}: key {key!r}: expected shape {shape}, found {array.shape}")
            arrays[key] = array
            continue
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
