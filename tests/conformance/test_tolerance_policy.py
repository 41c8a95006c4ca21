"""The policy file as read, and the bf16 nRMSE exemption counted in the tokens behind each result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.checks.catalogue import CheckSpec
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from tests.conformance.absolute import compare
from tests.conformance.numpy_adapter import NumpyAdapter

POLICY = TolerancePolicy.load()
BF16, RFC_BF16 = POLICY.gate["bf16"], POLICY.rfc["bf16"]
STATE_AXES = ("seq", "head", "key", "value")
MIN = POLICY.min_tokens


def test_override_reasons_read_as_plain_sentences() -> None:
    for override in POLICY.overrides:
        assert "\\" not in override.reason and "\n" not in override.reason, override.check


def _states_with_noise(noisy_seqs: list[int], num_seqs: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """States of 0.1 with an error of 5e-3 in the given sequences: inside bf16's element-wise limit
    (1e-2 + 1e-2·0.1), ten times its nRMSE limit."""
    reference = np.full((num_seqs, 2, 4, 4), 0.1, np.float32)
    actual = reference.copy()
    actual[noisy_seqs] += 5e-3
    return actual, reference


def test_state_of_a_short_sequence_is_exempt_from_the_nrmse_limit() -> None:
    actual, reference = _states_with_noise([0, 1, 2])
    comparison = compare(
        actual, reference, BF16, RFC_BF16, STATE_AXES, seq_lens=(5, 17, 1, 41), min_tokens=MIN
    )
    assert (
        comparison.passed and comparison.measurement.nrmse_gated and comparison.measurement.gated_nrmse == 0.0
    )
    assert comparison.measurement.nrmse > BF16.max_nrmse  # reported over the whole state
    one_token = compare(
        actual[2:3], reference[2:3], BF16, RFC_BF16, STATE_AXES, seq_lens=(1,), min_tokens=MIN
    )
    assert one_token.passed and not one_token.measurement.nrmse_gated


def test_state_of_a_long_sequence_keeps_the_nrmse_limit() -> None:
    actual, reference = _states_with_noise([3])
    comparison = compare(
        actual, reference, BF16, RFC_BF16, STATE_AXES, seq_lens=(5, 17, 1, 41), min_tokens=MIN
    )
    assert comparison.failures == ["normalised RMSE 0.05 > 0.005 over the sequences of >= 32 tokens"]
    assert comparison.gate_ratio == pytest.approx(10, rel=1e-3)


def test_sequence_lengths_must_match_the_states() -> None:
    actual, reference = _states_with_noise([])
    with pytest.raises(ValueError, match="3 sequence lengths for a result of 4 sequences"):
        compare(actual, reference, BF16, RFC_BF16, STATE_AXES, seq_lens=(1, 2, 3), min_tokens=MIN)


def test_the_suite_counts_the_tokens_behind_each_state(synthetic_dumps: Path) -> None:
    runner = CheckRunner(DumpSet(str(synthetic_dumps)), NumpyAdapter, "auto", POLICY)
    assert not runner.run(CheckSpec("T1", "bf16", "layer-state")).comparison.measurement.nrmse_gated
    assert runner.run(CheckSpec("T65", "bf16", "layer-state")).comparison.measurement.nrmse_gated
    assert not runner.run(CheckSpec("T8", "bf16", "layer")).comparison.measurement.nrmse_gated
