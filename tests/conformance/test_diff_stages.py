"""diff's kernel stage inside the layer, its word for a pure scale error, and heatmaps of what decided."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.tools.diff import (
    LAYER_KERNEL_OWN,
    LAYER_KERNEL_RERUN,
    StageResult,
    first_out_of_tolerance,
    run_stages,
    table_lines,
)
from conformance.tools.diff_heatmap import judged_ratio, shown_gate
from kda_spec.truth import packed_delta_rule
from tests.conformance.numpy_adapter import NumpyAdapter
from tests.conformance.synthetic import write_dump_set

CASE = "T65"


@pytest.fixture(scope="module")
def truth_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dump_set(tmp_path_factory.mktemp("diff-stages"), (CASE,), truth=True)


class HeadsSwappedInTheLayer(NumpyAdapter):
    """The layer calls its (right) kernel with the heads in reverse order, and returns that output as
    `o_kda`; called directly, the kernel methods are right."""

    name = "broken: the layer's kernel call reverses the heads"

    def forward(self, x, cu_seqlens, carry):
        result = super().forward(x, cu_seqlens, carry)
        q, k, v = (result.intermediates[f"{p}_after_conv"][:, ::-1] for p in "qkv")
        g, beta = result.intermediates["g"][:, ::-1], result.intermediates["beta"][:, ::-1]
        o, _ = packed_delta_rule(
            *(self._l2(a) for a in (q, k)), v, g, beta, cu_seqlens, carry.recurrent_state
        )
        result.intermediates["o_kda"] = self.cast(o)
        return result

    @staticmethod
    def _l2(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


class KernelTimesEight(NumpyAdapter):
    """The chunk kernel forgets the D^-1/2 scale of q (D = 64 would make it ×8): here its output ×8."""

    name = "broken: chunk kernel output ×8"

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        o, state = super().chunk_kernel(q, k, v, g, beta, cu_seqlens, initial_state)
        return o * np.float32(8), state


class ONormOff(NumpyAdapter):
    """The gated RMSNorm's output 0.1% off (reported as an intermediate only)."""

    name = "broken: o_norm 0.1% off"

    def forward(self, x, cu_seqlens, carry):
        result = super().forward(x, cu_seqlens, carry)
        result.intermediates["o_norm"] = result.intermediates["o_norm"] * np.float32(1.001)
        return result


def _stages(dumps: Path, adapter: type[NumpyAdapter]) -> tuple[dict[str, StageResult], list[StageResult]]:
    """The fp32 stages of the case: by result key, and in the layer's order."""
    runner = CheckRunner(DumpSet(str(dumps)), adapter, "auto", TolerancePolicy.load())
    results = run_stages(runner, CASE, "fp32")
    return {row.key: row for row in results}, results


def test_the_layers_own_kernel_output_is_the_kernel_stage_when_the_adapter_returns_it(
    truth_dumps: Path,
) -> None:
    by_key, results = _stages(truth_dumps, HeadsSwappedInTheLayer)
    first = first_out_of_tolerance(results)
    assert first.result == LAYER_KERNEL_OWN and first.stage == "kernel"
    assert by_key["o_kda_chunk"].comparison.passed  # the kernel itself, on the dumped inputs
    honest = {row.key: row for row in _stages(truth_dumps, NumpyAdapter)[1]}
    assert honest["o_kda"].result == LAYER_KERNEL_RERUN and honest["o_kda"].comparison.passed


def test_a_pure_scale_error_is_named_with_its_factor(truth_dumps: Path) -> None:
    _, results = _stages(truth_dumps, KernelTimesEight)
    lines = table_lines(results)
    assert first_out_of_tolerance(results).key == "o_kda_chunk"
    scale = next(line for line in lines if "a scale error" in line)
    assert "o_kda_chunk is 8 × the reference (100.0% of the squared error lies along it)" in scale
    honest = table_lines(_stages(truth_dumps, NumpyAdapter)[1])
    assert not any("a scale error" in line for line in honest)


def test_the_heatmap_shows_the_gate_that_decided(truth_dumps: Path) -> None:
    """A stage failed by the relative gate is drawn against the truth (o_norm, fp32, mode relative); one
    failed by the absolute gate against the reference (the kernel, absolute+relative, absolute first)."""
    o_norm = _stages(truth_dumps, ONormOff)[0]["o_norm"]
    assert o_norm.comparison.judged_by == "relative" and not o_norm.comparison.passed
    assert shown_gate(o_norm.comparison) == "relative"
    ratio, label = judged_ratio(o_norm)
    assert "truth" in label and ratio.max() > 1 and ratio.shape == o_norm.checked.sides.actual.shape
    kernel = _stages(truth_dumps, HeadsSwappedInTheLayer)[0]["o_kda"]
    assert shown_gate(kernel.comparison) == "absolute" and "ref" in judged_ratio(kernel)[1]
