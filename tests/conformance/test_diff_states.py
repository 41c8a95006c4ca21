"""diff's state stages: a final state off while its output holds is named as a state defect, and drawn."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from conformance.checks.runner import CheckRunner
from conformance.cli import main
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.tools.diff import run_stages, stage_to_look_at, state_defects, table_lines
from conformance.tools.diff_heatmap import state_panels
from tests.conformance.numpy_adapter import NumpyAdapter

CASE = "varlen_initstate"  # 4 sequences with initial states
LONG_CASE = "T65"  # one sequence of 65 tokens: chunked prefill runs (varlen_initstate has a 1-token one)
OFF_AT = (-1, 1, 3, 5)  # (sequence, head, key, value) of the one state entry the broken adapters move
OFFSET = 1e-2  # far outside the fp32 state tolerance, far from anything a real result would show


def _off(state: np.ndarray) -> np.ndarray:
    state = np.array(state, np.float32)
    state[OFF_AT] += OFFSET
    return state


class ChunkStateOff(NumpyAdapter):
    """The chunk kernel's final state has one entry off; its output, and everything else, is right."""

    name = "broken: chunk kernel's final state off"

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        o, state = super().chunk_kernel(q, k, v, g, beta, cu_seqlens, initial_state)
        return o, _off(state)


class LayerStateOff(NumpyAdapter):
    """The layer reports a final state with one entry off; the state it carries on is right."""

    name = "broken: layer's reported final state off"

    def layer_extend(self, *args, **kwargs):
        result = super().layer_extend(*args, **kwargs)
        return dataclasses.replace(result, final_state=_off(result.final_state))


def _stages(dumps: Path, adapter: type[NumpyAdapter], case: str = CASE):
    runner = CheckRunner(DumpSet(str(dumps)), adapter, "auto", TolerancePolicy.load())
    return run_stages(runner, case, "fp32")


def test_a_chunk_state_off_with_its_output_holding_is_a_state_defect(synthetic_dumps: Path) -> None:
    results = _stages(synthetic_dumps, ChunkStateOff)
    by_key = {row.key: row for row in results}
    assert by_key["o_kda_chunk"].comparison.passed
    assert not by_key["recurrent_state_chunk"].comparison.passed
    assert [(row.key, what) for row, what in state_defects(results)] == [
        ("recurrent_state_chunk", "the chunk kernel's final state")
    ]
    assert stage_to_look_at(results).key == "recurrent_state_chunk"
    lines = table_lines(results)
    assert any(
        line.startswith(
            "state defect: the chunk kernel's final state (recurrent_state_chunk) leaves tolerance "
            "while its output holds"
        )
        for line in lines
    )
    # The worst element is where the adapter moved it, and the panels put it on its head at key × value.
    worst = by_key["recurrent_state_chunk"].comparison.measurement.worst["index"]
    num_seqs = by_key["recurrent_state_chunk"].checked.sides.actual.shape[0]
    assert (worst["seq"], worst["head"], worst["key"], worst["value"]) == (num_seqs - 1, *OFF_AT[1:])
    panels = state_panels(by_key["recurrent_state_chunk"])
    assert panels.shape == by_key["recurrent_state_chunk"].checked.sides.actual.shape[1:]
    assert np.unravel_index(np.argmax(panels), panels.shape) == OFF_AT[1:]


def test_the_layers_state_off_names_the_layer_and_chunked_prefill(synthetic_dumps: Path) -> None:
    results = _stages(synthetic_dumps, LayerStateOff, LONG_CASE)
    defects = [(row.key, what) for row, what in state_defects(results)]
    assert defects == [
        ("layer_state", "the layer's final state"),
        ("layer_kernel_state", "the layer's final state on its own kernel inputs"),
        ("chunked_state", "chunked prefill's carried state"),
    ]
    by_key = {row.key: row for row in results}
    assert by_key["out"].comparison.passed and by_key["chunked_out"].comparison.passed


def test_a_correct_implementation_has_no_state_defect(synthetic_dumps: Path) -> None:
    results = _stages(synthetic_dumps, NumpyAdapter, LONG_CASE)
    compared = {row.key for row in results if row.comparison is not None}
    assert {
        "recurrent_state_chunk",
        "recurrent_state_fused_recurrent",
        "layer_state",
        "chunked_state",
    } <= compared
    assert state_defects(results) == [] and stage_to_look_at(results) is None


def test_diff_draws_the_state_defect_by_default(
    synthetic_dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png = tmp_path / "state.png"
    impl = f"{__name__}:ChunkStateOff"
    code = main(["diff", "--dumps", str(synthetic_dumps), "--case", CASE, "--impl", impl, "--png", str(png)])
    out = capsys.readouterr().out
    assert code == 1
    assert "state defect: the chunk kernel's final state (recurrent_state_chunk)" in out
    assert f"heatmap of recurrent_state_chunk written to {png}" in out
    assert png.read_bytes().startswith(b"\x89PNG")
