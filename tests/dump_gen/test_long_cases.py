"""The optional `long` case group: selected by name only, stored lean, its truth computed block by block."""

from __future__ import annotations

import numpy as np
import pytest

from dump_gen import generate
from dump_gen.inputs import case_inputs
from kda_spec import dump_format as fmt
from kda_spec.config import get_preset
from kda_spec.dump_writer import case_group_fields
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.truth import bf16_contract_rounding, bf16_rounded, layer_output_truth, layer_truth, run_weights

TINY_CONFIG = get_preset("mini").replace(hidden_size=32, head_dim=16, preset="custom")


def test_long_group_is_made_only_when_named() -> None:
    assert not {case.group for case in fmt.select_cases(None)} - {None}
    long_ids = ["long_T16384", "long_prefill8192_decode512"]
    assert [case.case_id for case in fmt.select_cases(["long"])] == long_ids
    assert [case.case_id for case in fmt.select_cases(["T1", "long", "long_T16384"])] == ["T1", *long_ids]
    decode = fmt.CASES_BY_ID["long_prefill8192_decode512"]
    assert decode.seq_lens == (8704,) and decode.decode_steps == 512
    with pytest.raises(ValueError, match=r"groups: \['long'\]"):
        fmt.select_cases(["longest"])


def test_long_cases_store_the_output_and_states_only() -> None:
    long_case, standard = fmt.CASES_BY_ID["long_prefill8192_decode512"], fmt.CASES_BY_ID["T1024"]
    stored = ("out", "recurrent_state_chunk", "recurrent_state_fused_recurrent")
    assert generate.result_names(long_case) == stored
    assert generate.result_names(standard) == generate.RESULT_ORDER
    assert case_group_fields(long_case) == {"group": "long", "decode_steps": 512}
    assert case_group_fields(fmt.CASES_BY_ID["long_T16384"]) == {"group": "long"}
    assert case_group_fields(standard) == {}


@pytest.mark.parametrize("block_tokens", [1, 5, 64, 4096])
def test_blockwise_truth_is_the_whole_sequence_truth(block_tokens: int) -> None:
    """Sequences of 5, 17, 1 and 41 tokens with initial states: blocks shorter than the conv (1), ending
    inside a sequence (5), longer than some sequences (64) and than all (4096)."""
    weights = synthetic_weights(TINY_CONFIG, seed=0)
    inputs = case_inputs(fmt.CASES_BY_ID["varlen_initstate"], TINY_CONFIG, seed=0)
    args = (weights, inputs.hidden_states, inputs.cu_seqlens, inputs.initial_state, TINY_CONFIG)
    whole = layer_truth(*args)
    blocks = layer_output_truth(*args, block_tokens=block_tokens)
    for name in ("out", "recurrent_state"):
        assert blocks[name].dtype == np.float64
        error = np.max(np.abs(blocks[name] - whole[name])) / np.max(np.abs(whole[name]))
        assert error < 1e-14, name
    with pytest.raises(ValueError, match="block_tokens"):
        layer_output_truth(*args, block_tokens=0)


def test_a_long_case_truth_runs_block_by_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above one block of tokens, without the intermediates' truth, dump_gen takes the blockwise truth;
    the twelve cases keep the whole-sequence one."""
    calls: list[int] = []

    def spy(weights, hidden_states, *args, **kwargs):
        calls.append(hidden_states.shape[0])
        return layer_output_truth(weights, hidden_states, *args, **kwargs)

    monkeypatch.setattr(generate, "layer_output_truth", spy)
    monkeypatch.setattr(generate, "BLOCK_TOKENS", 16)
    weights = synthetic_weights(TINY_CONFIG, seed=0)
    truth_weights = {dtype: run_weights(weights, dtype, TINY_CONFIG) for dtype in generate.RUN_DTYPES}
    for case_id, expected_calls in (("T65", [65, 65]), ("T8", [])):
        calls.clear()
        case = fmt.CASES_BY_ID[case_id]
        inputs = case_inputs(case, TINY_CONFIG, seed=0)
        arrays = generate.truth_arrays(case, inputs, truth_weights, TINY_CONFIG, generate.TRUTH_ALWAYS)
        assert calls == expected_calls
        assert set(arrays) == {fmt.truth_key(n, d) for n in generate.TRUTH_ALWAYS for d in fmt.DTYPES}


@pytest.mark.parametrize("block_tokens", [5, 64])
def test_blockwise_contract_model_is_the_whole_sequence_model(block_tokens: int) -> None:
    """The bf16 precision contract's model of a long case (conformance.checks.truth) is computed block by
    block too: the same roundings, so the same values, up to a float64 sum landing on the other side of a bf16
    rounding boundary in a rare element."""
    weights = run_weights(synthetic_weights(TINY_CONFIG, seed=0), "bf16", TINY_CONFIG)
    inputs = case_inputs(fmt.CASES_BY_ID["varlen_initstate"], TINY_CONFIG, seed=0)
    args = (weights, bf16_rounded(inputs.hidden_states), inputs.cu_seqlens, inputs.initial_state, TINY_CONFIG)
    whole = layer_truth(*args, rounded=bf16_contract_rounding)
    blocks = layer_output_truth(*args, block_tokens=block_tokens, rounded=bf16_contract_rounding)
    assert np.array_equal(bf16_rounded(whole["out"]), whole["out"])  # the model's out is on the bf16 grid
    for name in ("out", "recurrent_state"):
        equal = np.mean(blocks[name] == whole[name])
        nrmse = np.linalg.norm(blocks[name] - whole[name]) / np.linalg.norm(whole[name])
        assert equal > 0.999 and nrmse < 1e-5, (name, equal, nrmse)
