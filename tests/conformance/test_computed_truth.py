"""The layer truth a dump leaves out for size is computed by the checker, exactly as dump_gen stores it.

golden/ stores the float64 truth of the intermediates only for its cases of <= 65 tokens; the checks of
its longer cases are judged against the same `kda_spec.truth` layer run here on the dump's own inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance import truth
from conformance.checks import CheckRunner
from conformance.reader import DumpSet
from conformance.tolerances import TolerancePolicy
from conformance.truth import COMPUTED_LAYER_TRUTH_SOURCE, NoTruth, computed_layer_truth
from kda_spec import dump_format as fmt
from tests.conformance.numpy_adapter import NumpyAdapter

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
    for name in fmt.TRUTH_NAMES:
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


def test_a_case_too_long_to_compute_has_no_truth(golden: DumpSet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(truth, "COMPUTE_MAX_TOKENS", 64)
    with pytest.raises(NoTruth, match="65 tokens, more than the 64"):
        computed_layer_truth(golden.case("T65"), "fp32", golden.weights(), golden.config)
