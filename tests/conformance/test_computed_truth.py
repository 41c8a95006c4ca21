"""The layer truth a dump does not store is computed by the checker, exactly as dump_gen stores it.

golden/ stores the float64 truth of the intermediates only for its cases of <= 65 tokens; the checks of
its longer cases are judged against the same `kda_spec.truth` layer run here on the dump's own inputs.
So is every check of a set that stores no truth at all (another tool's, or one older than the truth
keys): whatever wrote it, it carries the weights and hidden states the truth is computed from.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from conformance.checks import truth
from conformance.checks.catalogue import CheckSpec
from conformance.checks.runner import CheckRunner
from conformance.checks.truth import COMPUTED_LAYER_TRUTH_SOURCE, NoTruth, computed_layer_truth
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from kda_spec import dump_format as fmt
from tests.conformance.numpy_adapter import NumpyAdapter
from tests.conformance.synthetic import write_dump_set

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


@pytest.fixture(scope="module")
def golden() -> DumpSet:
    return DumpSet(str(GOLDEN))


@pytest.mark.parametrize("dtype", fmt.DTYPES)
def test_the_computed_truth_is_bit_identical_to_the_stored_one(golden: DumpSet, dtype: str) -> None:
    """On a case that stores every truth, the checker's computation reproduces each array: same code,
    same rounding of the run's inputs and weights. Bit for bit on the machine that wrote the set; within
    a few float64 ulps elsewhere, since numpy's OpenBLAS picks its matmul kernels (and so the order of
    their sums) by CPU (on an AMD EPYC, golden's T65 differs from the stored truth by <= 3.6e-15)."""
    case = golden.case("T65")
    computed = computed_layer_truth(case, dtype, golden.weights(), golden.config)
    assert set(computed) >= set(fmt.TRUTH_NAMES)
    for name in golden.manifest["truth"]["names"]:  # a set made before the raw gate has no g_raw
        stored = case.arrays[fmt.truth_key(name, dtype)]
        assert computed[name].dtype == np.float64
        np.testing.assert_allclose(
            computed[name], stored, rtol=1e-13, atol=1e-15, err_msg=f"{name} ({dtype})"
        )


def test_a_longer_case_is_judged_against_the_computed_truth(golden: DumpSet) -> None:
    runner = CheckRunner(golden, NumpyAdapter, "auto", TolerancePolicy.load())
    case = runner.case("T128")
    assert fmt.truth_key("o_norm", "bf16") not in case.arrays  # left out of golden for size
    value, source = runner.layer_truth(case, "o_norm", "bf16")
    assert source == COMPUTED_LAYER_TRUTH_SOURCE
    assert value.shape == case.result("o_norm", "bf16").shape and value.dtype == np.float64
    _, out_source = runner.layer_truth(case, "out", "bf16")
    assert out_source == f"dump: {fmt.truth_key('out', 'bf16')}"  # a stored truth is preferred


def test_a_case_too_long_to_compute_whole_has_the_truth_of_its_output_and_states_only(
    golden: DumpSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the bound the checker computes `out` and the final states block by block, the same numbers
    as the whole layer; an intermediate's check says why it has no truth."""
    case = golden.case("T128")  # stores no intermediate's truth
    whole = computed_layer_truth(case, "bf16", golden.weights(), golden.config)
    monkeypatch.setattr(truth, "COMPUTE_MAX_TOKENS", 127)
    blocks = computed_layer_truth(case, "bf16", golden.weights(), golden.config)
    assert sorted(blocks) == ["out", "recurrent_state"]
    for name, value in blocks.items():
        np.testing.assert_allclose(value, whole[name], rtol=1e-13, atol=1e-15, err_msg=name)
    runner = CheckRunner(golden, NumpyAdapter, "auto", TolerancePolicy.load())
    with pytest.raises(NoTruth, match=r"128 tokens \(over the 127 .* has no 'o_norm'"):
        runner.layer_truth(runner.case("T128"), "o_norm", "bf16")


def without_truth(source: Path, destination: Path) -> Path:
    """A copy of the dump set at `source` as a tool that knows nothing of the truth writes it: no `truth`
    block in the manifest, no truth key in any case file (each case's sha256 and keys updated)."""
    manifest = json.loads((source / fmt.MANIFEST_FILE).read_text())
    manifest.pop("truth", None)
    (destination / fmt.CASES_DIR).mkdir(parents=True)
    (destination / fmt.WEIGHTS_FILE).write_bytes((source / fmt.WEIGHTS_FILE).read_bytes())
    for entry in manifest["cases"]:
        with np.load(source / entry["file"]) as stored:
            arrays = {key: stored[key] for key in stored.files if fmt.split_truth_key(key) is None}
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        (destination / entry["file"]).write_bytes(buffer.getvalue())
        entry["sha256"] = fmt.sha256_bytes(buffer.getvalue())
        entry["keys"] = [key for key in entry["keys"] if key in arrays]
    (destination / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    return destination


@pytest.fixture(scope="module")
def golden_without_truth(tmp_path_factory: pytest.TempPathFactory) -> DumpSet:
    return DumpSet(str(without_truth(GOLDEN, tmp_path_factory.mktemp("golden-without-truth"))))


@pytest.mark.parametrize("name", ["out", "recurrent_state", "o_norm"])
def test_a_set_without_truth_gets_the_truth_it_would_have_stored(
    golden: DumpSet, golden_without_truth: DumpSet, name: str
) -> None:
    runner = CheckRunner(golden_without_truth, NumpyAdapter, "auto", TolerancePolicy.load())
    case = runner.case("T65")
    assert not any(fmt.split_truth_key(key) for key in case.arrays)
    value, source = runner.layer_truth(case, name, "bf16")
    assert source == COMPUTED_LAYER_TRUTH_SOURCE
    stored = golden.case("T65").arrays[fmt.truth_key(name, "bf16")]
    np.testing.assert_allclose(value, stored, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("check", ["layer", "layer-state", "o_norm", "decode-k1"])
def test_every_check_of_a_set_without_truth_has_a_verdict(tmp_path: Path, check: str) -> None:
    """A set written by another tool (here the numpy reference of tests/conformance/synthetic.py, which
    stores no truth) is judged against the float64 truth all the same, in the check's own mode."""
    dumps = DumpSet(str(write_dump_set(tmp_path, ("varlen_initstate",), truth=False)))
    assert "truth" not in dumps.manifest
    policy = TolerancePolicy.load()
    runner = CheckRunner(dumps, NumpyAdapter, "auto", policy)
    comparison = runner.run(CheckSpec("varlen_initstate", "bf16", check)).comparison
    assert comparison.attribution is not None, comparison.no_truth
    assert comparison.attribution.source == COMPUTED_LAYER_TRUTH_SOURCE
    assert comparison.judged_by == policy.mode(check, "bf16")
