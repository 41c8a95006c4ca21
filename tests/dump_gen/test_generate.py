"""Generated sets: valid, the CPU references agree, bf16 as bits, deterministic, atomic, any fsspec URL."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pytest

from dump_gen.capture import gate_input_module
from dump_gen.references.transformers_names import HF_TO_TRANSFORMERS
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.families import GLM5_NEXT, KIMI_LINEAR, canonical_weights
from kda_spec.truth import raw_gate_decay
from tests.dump_gen.conftest import CASES, dump
from tests.dump_gen.validate import read_manifest, read_npz, split_key, validate_set

pytestmark = pytest.mark.torch


def case_arrays(root: str | Path, case_id: str) -> dict[str, np.ndarray]:
    entry = next(case for case in read_manifest(str(root))["cases"] if case["id"] == case_id)
    return read_npz(str(root), entry["file"], entry["sha256"])


def test_set_is_valid(transformers_set: Path) -> None:
    manifest = validate_set(str(transformers_set))
    assert [case["id"] for case in manifest["cases"]] == CASES
    assert manifest["config"]["hidden_size"] == 32 and manifest["config"]["head_dim"] == 16
    assert manifest["reference"]["name"] == "transformers" and manifest["weights"]["source"] == "synthetic"
    paths = {case["id"]: case["layer_kernel_path_per_seq"] for case in manifest["cases"]}
    # A prefill takes the chunk kernel; a one-token sequence that continues a state, the recurrent one.
    assert paths == {
        "T1": ["chunk"],
        "T65": ["chunk"],
        "varlen_initstate": ["chunk", "chunk", "fused_recurrent", "chunk"],
    }
    assert all(case["layer_kernel_path"] == "chunk" for case in manifest["cases"])


def test_cpu_references_agree(transformers_set: Path, fla_set: Path) -> None:
    """transformers' own torch kernels vs fla-core's naive kernels in the same layer, same weights: fp32
    within the RFC's 1e-5, and the two kernel paths of each set agree with each other."""
    for case_id in CASES:
        ours, theirs = case_arrays(transformers_set, case_id), case_arrays(fla_set, case_id)
        assert list(ours) == list(theirs)
        for key in ours:
            if split_key(key)[1] == "fp32":
                np.testing.assert_allclose(
                    ours[key], theirs[key], atol=1e-5, rtol=1e-5, err_msg=f"{case_id} {key}"
                )
        np.testing.assert_allclose(ours["o_kda_chunk"], ours["o_kda_fused_recurrent"], atol=1e-5, rtol=1e-5)


def test_bf16_keys_hold_bf16_bits(transformers_set: Path) -> None:
    arrays = case_arrays(transformers_set, "T65")
    names = (
        fmt.OUTPUT_KEY,
        "o_kda_chunk",
        "o_kda_fused_recurrent",
        "q_after_conv",
        "g_raw",
        "g_out",
        "o_norm",
    )
    for name in names:
        bits = arrays[fmt.result_key(name, "bf16")]
        assert bits.dtype == np.uint16, name
        values, reference = fmt.bf16_bits_to_float32(bits), arrays[fmt.result_key(name, "fp32")]
        error = np.linalg.norm(values - reference) / np.linalg.norm(reference)
        assert 0 < error < 3e-2, f"{name}: bf16 run vs fp32 run, normalised RMSE {error}"
    for name in fmt.FP32_IN_BF16_RUN:
        assert arrays[fmt.result_key(name, "bf16")].dtype == np.float32, name


def test_g_raw_is_the_input_of_the_references_gate(transformers_set: Path) -> None:
    """The dumped raw gate (the reference's `f_b_proj` output) is what its gate made the dumped g from:
    the float64 gate of g_raw, A_log and dt_bias is g to fp32 rounding (of the largest |g|), in both
    runs."""
    manifest = read_manifest(str(transformers_set))
    config = KDAConfig.from_manifest(manifest["config"])
    stored = read_npz(str(transformers_set), manifest["weights"]["file"], manifest["weights"]["sha256"])
    weights = {name: np.asarray(w, np.float64) for name, w in canonical_weights(config, stored).items()}
    for case_id in CASES:
        arrays = case_arrays(transformers_set, case_id)
        for dtype in fmt.DTYPES:
            g_raw = fmt.decode_array(arrays[fmt.result_key("g_raw", dtype)]).astype(np.float64)
            g = arrays[fmt.result_key("g", dtype)]
            gate = raw_gate_decay(g_raw, weights["A_log"], weights["dt_bias"], config)
            # transformers' fp32 gate: log(1 + exp(f)) loses a small value's relative accuracy, not
            # more than fp32 rounding of the largest
            error = np.abs(gate - g).max() / np.abs(g).max()
            assert error < 1e-6, (case_id, dtype, error)
    assert gate_input_module(KIMI_LINEAR, HF_TO_TRANSFORMERS.__getitem__) == "forget_gate.f_b_proj"
    assert gate_input_module(KIMI_LINEAR) == "f_b_proj"  # the hub file's
    assert gate_input_module(GLM5_NEXT) == "forget_gate.f_b_proj"


def test_deterministic(transformers_set: Path, tmp_path: Path) -> None:
    """Same seed, same reference: byte-identical files; a subset of the cases gets the same inputs."""
    assert dump(tmp_path / "again", "--reference", "transformers") == 0
    for name in ["weights.npz", *(f"cases/{case}.npz" for case in CASES)]:
        assert (tmp_path / "again" / name).read_bytes() == (transformers_set / name).read_bytes(), name
    first, second = read_manifest(str(transformers_set)), read_manifest(str(tmp_path / "again"))
    first.pop("created"), second.pop("created")
    assert first == second
    assert dump(tmp_path / "subset", "--reference", "transformers", cases=["varlen_initstate"]) == 0
    subset = case_arrays(tmp_path / "subset", "varlen_initstate")
    np.testing.assert_array_equal(
        subset["hidden_states"], case_arrays(transformers_set, "varlen_initstate")["hidden_states"]
    )


def test_memory_round_trip(transformers_set: Path) -> None:
    url = "memory://dump_gen-test/round-trip"
    assert dump(url, cases=["varlen_initstate"]) == 0
    manifest = validate_set(url)
    arrays = case_arrays(url, "varlen_initstate")
    expected = case_arrays(transformers_set, "varlen_initstate")
    assert list(arrays) == list(expected) == manifest["cases"][0]["keys"]
    for key in arrays:
        np.testing.assert_array_equal(arrays[key], expected[key], err_msg=key)
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(root, recursive=True)
