"""A strict check of a written dump set against format v1, for the tests: schema, checksums, shapes, dtype,
and the float64 truth of both runs."""

from __future__ import annotations

import io
import json

import fsspec
import numpy as np

from kda_spec import dump_format as fmt

MANIFEST_FIELDS = {
    "format",
    "version",
    "config",
    "reference",
    "seed",
    "weights",
    "created",
    "generator",
    "truth",
    "cases",
}
CASE_FIELDS = {"id", "file", "sha256", "seq_lens", "initial_state", "layer_kernel_path", "keys"}


def read_manifest(url: str) -> dict:
    fs, root = fsspec.core.url_to_fs(url)
    return json.loads(fs.cat_file(f"{root}/{fmt.MANIFEST_FILE}"))


def read_npz(url: str, relpath: str, sha256: str) -> dict[str, np.ndarray]:
    fs, root = fsspec.core.url_to_fs(url)
    data = fs.cat_file(f"{root}/{relpath}")
    assert fmt.sha256_bytes(data) == sha256, f"{relpath}: sha256 mismatch"
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def split_key(key: str) -> tuple[str, str]:
    """A result key as (name, dtype); a truth key as (name, "fp64") or (name, "bf16_fp64")."""
    truth = fmt.split_truth_key(key)
    if truth is not None:
        name, dtype = truth
        return name, "fp64" if dtype == "fp32" else "bf16_fp64"
    if key.startswith("out_"):
        return "out", key[len("out_") :]
    if key.endswith("_bf16"):
        return key[: -len("_bf16")], "bf16"
    return key, "fp32"


def validate_set(url: str) -> dict:
    """The manifest of the valid dump set at `url`; AssertionError naming the first violation."""
    manifest = read_manifest(url)
    assert set(manifest) >= MANIFEST_FIELDS, f"manifest lacks {MANIFEST_FIELDS - set(manifest)}"
    assert manifest["format"] == fmt.FORMAT_NAME and manifest["version"] == fmt.FORMAT_VERSION
    config = manifest["config"]
    assert set(manifest["reference"]) >= {"name", "versions", "device", "patches"}
    truth = manifest["truth"]
    assert truth["dtype"] == fmt.TRUTH_DTYPE and truth["implementation"].startswith("kda_spec.truth")
    assert set(truth["names"]) <= set(fmt.TRUTH_NAMES), truth["names"]
    weights = read_npz(url, manifest["weights"]["file"], manifest["weights"]["sha256"])
    expected_weights = fmt.weight_shapes(config)
    assert list(weights) == list(expected_weights)
    for name, shape in expected_weights.items():
        assert weights[name].shape == shape and weights[name].dtype == np.float32, name
    for case in manifest["cases"]:
        assert set(case) >= CASE_FIELDS, f"case entry lacks {CASE_FIELDS - set(case)}"
        spec = fmt.CASES_BY_ID[case["id"]]
        assert case["file"] == spec.file and case["seq_lens"] == list(spec.seq_lens)
        assert case["initial_state"] == spec.initial_state
        assert case["layer_kernel_path"] in ("chunk", "fused_recurrent")
        arrays = read_npz(url, case["file"], case["sha256"])
        assert list(arrays) == case["keys"]
        tokens, num_seqs = spec.total_tokens, len(spec.seq_lens)
        np.testing.assert_array_equal(arrays["cu_seqlens"], np.cumsum([0, *spec.seq_lens]))
        assert arrays["cu_seqlens"].dtype == np.int32
        assert ("initial_recurrent_state" in arrays) == spec.initial_state
        for key, array in arrays.items():
            name, dtype = (key, "fp32") if key in fmt.INPUT_KEYS else split_key(key)
            assert array.shape == fmt.expected_shape(name, tokens=tokens, num_seqs=num_seqs, config=config), (
                key
            )
            if key == "cu_seqlens":
                continue
            if dtype in ("fp64", "bf16_fp64"):
                assert array.dtype == np.float64, f"{key}: {array.dtype}"
            else:
                bits = dtype == "bf16" and name not in fmt.FP32_IN_BF16_RUN
                # a gradient of a weight the bf16 run keeps in fp32 (A_log, dt_bias, ...) is float32
                allowed = [np.uint16, np.float32] if bits and name in fmt.GRADIENT_RESULT_KEYS else []
                allowed = allowed or [np.uint16 if bits else np.float32]
                assert array.dtype in [np.dtype(kind) for kind in allowed], f"{key}: {array.dtype}"
            assert np.isfinite(fmt.decode_array(array)).all(), key
        for dtype in fmt.DTYPES:
            for name in (fmt.OUTPUT_KEY, *fmt.KERNEL_KEYS):
                assert fmt.result_key(name, dtype) in arrays, (
                    f"{case['id']}: no {fmt.result_key(name, dtype)}"
                )
            with_intermediates = tokens <= truth["intermediates_max_tokens"]
            for name in fmt.TRUTH_NAMES:
                stored = fmt.truth_key(name, dtype) in arrays
                assert stored == (name in ("out", "recurrent_state") or with_intermediates), (
                    f"{case['id']}: {fmt.truth_key(name, dtype)} {'stored' if stored else 'missing'}"
                )
    return manifest
