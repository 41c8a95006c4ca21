"""diff decides every check of the case: a failing check outside its stage table fails the diff, a failing
decode or chunked prefill is walked to the call where it departs, a stage off the bf16 contract is named
with its rounding point, and an adapter with kernels alone gets its kernel stages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.checks.runner import CheckRunner
from conformance.cli import main
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.tools.diff_case import case_lines, run_case
from conformance.tools.diff_contract import ROUNDING_POINTS, what_the_implementation_does
from tests.conformance.broken_adapters import NumpyConvOffAfterSplit
from tests.conformance.numpy_adapter import round_bf16

CASE = "T65"  # one sequence: decode-k8 decodes tokens 57 to 64, decode-all tokens 1 to 64
BROKEN = "tests.conformance.broken_adapters"


def _diff(dumps: Path, adapter: str, capsys: pytest.CaptureFixture, dtype: str = "fp32") -> tuple[int, str]:
    code = main(["diff", "--dumps", str(dumps), "--case", CASE, "--dtype", dtype, "--impl", adapter])
    return code, capsys.readouterr().out


def test_a_failing_decode_fails_the_diff_and_is_named_by_step_and_stage(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _diff(synthetic_dumps, f"{BROKEN}:NumpyDecodeOffAfterSteps", capsys)
    assert code == 1 and "every stage compared holds" not in out
    assert (
        "no stage compared is out of tolerance, but the case fails outside the stage table: decode-k8," in out
    )
    k8 = out[out.index("decode-k8, call by call") : out.index("decode-all, call by call")]
    assert "first call out of tolerance: step 3 (token 60)" in k8  # its fourth step: 57, 58, 59 hold
    assert "the stages at step 3, against the dump:" in k8
    assert "first out of tolerance: conv (q_after_conv):" in k8
    assert "first call out of tolerance: step 3 (token 4)" in out  # decode-all, from token 1
    assert "decode-k8-self, call by call" not in out  # walked against the dump already
    assert "decode-k1 " in out and "decode-k1-self" in out  # decided too, and holding


def test_a_fault_outside_the_stage_table_exits_as_a_fault(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _diff(synthetic_dumps, f"{BROKEN}:NumpyDecodeRaises", capsys)
    assert code == 3
    assert "ERROR" in out and "decode exploded" in out


def test_a_decode_without_intermediates_is_named_by_step(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _diff(synthetic_dumps, f"{BROKEN}:NumpyDecodeOffNoIntermediates", capsys)
    assert code == 1
    assert "first call out of tolerance: step 3 (token 60)" in out
    assert "the adapter's layer_decode returns no intermediates: the output per call only" in out
    assert "the stages at step 3" not in out


def test_a_chunked_prefill_is_walked_piece_by_piece(synthetic_dumps: Path) -> None:
    runner = CheckRunner(
        DumpSet(str(synthetic_dumps)), NumpyConvOffAfterSplit, "auto", TolerancePolicy.load()
    )
    diff = run_case(runner, CASE, "fp32")
    assert diff.failed
    (walked,) = diff.walks
    assert walked.check == "chunked-prefill" and walked.named.label == "piece 1" and walked.departs
    lines = case_lines(diff)
    assert "first call out of tolerance: piece 1 (21 tokens)" in lines
    assert any(line.startswith("  first out of tolerance: conv (q_after_conv)") for line in lines)


def test_a_bf16_stage_off_the_contract_is_named_with_its_rounding_point(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _diff(synthetic_dumps, f"{BROKEN}:NumpyBetaRoundedToBf16", capsys, "bf16")
    assert code == 1
    assert (
        "beta departs from the contract's model at rounding point 7 'beta' (docs/bf16-rounding.md): the "
        "contract rounds b_proj's output to bf16, takes the sigmoid in fp32 and keeps beta fp32; the "
        "implementation rounds it to bf16 here, where the contract keeps fp32 (100.0% of its values are bf16"
    ) in out


def test_what_the_implementation_does_at_a_rounding_point() -> None:
    """Each of the three departures, from the stage's values and the model's."""
    rng = np.random.default_rng(0)
    exact = rng.normal(size=4096).astype(np.float32)
    model = round_bf16(exact).astype(np.float64)
    conv = ROUNDING_POINTS["k_after_conv"]
    assert what_the_implementation_does(conv, exact, model).startswith(
        "the implementation does not round here"
    )
    twice = round_bf16(round_bf16(exact * np.float32(1.001)))
    assert "rounds here as the contract does, but from different values" in what_the_implementation_does(
        conv, twice, model
    )
    beta = ROUNDING_POINTS["beta"]
    assert "keeps it fp32 as the contract does" in what_the_implementation_does(beta, exact * 1.01, exact)


def test_an_adapter_with_kernels_alone_gets_its_kernel_stages(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _diff(synthetic_dumps, "tests.conformance.kernel_only_adapter:KernelOnlyAdapter", capsys)
    assert code == 0 and "every stage compared holds" in out
    rows = {
        line.split()[1]: line for line in out.splitlines() if line.startswith(("conv ", "kernel ", "out "))
    }
    assert " ok " in rows["o_kda_chunk"] and " ok " in rows["recurrent_state_fused_recurrent"]
    assert "skip" in rows["q_after_conv"] and "implements no layer" in rows["out"]
    assert "decode-all" in out and "call by call" not in out


def test_a_clean_case_holds_everywhere(synthetic_dumps: Path, capsys: pytest.CaptureFixture) -> None:
    code, out = _diff(synthetic_dumps, "tests.conformance.numpy_adapter:NumpyAdapter", capsys)
    assert code == 0 and "every stage compared holds" in out
    assert "OUT" not in out and "call by call" not in out
