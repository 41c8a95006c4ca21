"""The chunk kernel's checkpoints (issue 43): `kernel-chunk-checkpoints` reads an adapter's
`CheckpointKernelAdapter.chunk_kernel_checkpoints` (fla's `return_intermediate_states`: the state entering
every 64-token chunk of every sequence) and judges each against the float64 recurrence's state after
that many tokens, as the kernel state checks are judged. kda_impl passes it in both families and runs;
checkpoints read one chunk late (its kernels' outputs and final states right) fail it, and `diff` names
them as a state defect of the kernel stage; an adapter without the protocol skips it with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conformance.adapter import unprovided
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.calls import l2norm
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import CHECKPOINT_KERNEL_TRUTH_SOURCE
from conformance.checks.truth import KERNEL_INPUTS
from conformance.dumps.reader import DumpSet
from conformance.search.dumpcase import CASE_ID
from conformance.tools.diff import run_stages, state_defects
from kda_spec.truth import chunk_starts, packed_chunk_start_states, packed_delta_rule
from tests.conformance.checkpoint_adapters import CheckpointOneChunkLate
from tests.conformance.family_case_sets import BOTH_RUNS_AND_GLM, check_runner, write_case_sets
from tests.conformance.kernel_only_adapter import KernelOnlyAdapter

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ADAPTERS_DOC = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"
CHECKPOINTS = Check(kinds.KERNEL_CHUNK_CHECKPOINTS)
SEQ_LENS = (150, 64, 30)  # 3, 1 and 1 chunks of 64: a partial last chunk, a whole one, a short sequence


@pytest.fixture(scope="module")
def case_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """One-case sets of SEQ_LENS, by (family, run)."""
    return write_case_sets(tmp_path_factory, BOTH_RUNS_AND_GLM, SEQ_LENS)


def test_the_truth_of_a_checkpoint_is_the_final_state_of_its_prefix() -> None:
    """vLLM's test_gdn_all_mode_prefill: chunk c's checkpoint of a prefill equals the final state of a
    fresh prefill of the sequence's first c·64 tokens; a sequence's first is its initial state."""
    rng = np.random.default_rng(43)
    heads, dim, lens = 2, 8, (150, 64, 30)
    tokens = sum(lens)
    q, k = (
        x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, tokens, heads, dim))
    )
    v = rng.standard_normal((tokens, heads, dim))
    g, beta = -rng.uniform(0, 0.5, (tokens, heads, dim)), rng.uniform(0, 1, (tokens, heads))
    init = rng.standard_normal((len(lens), heads, dim, dim))
    cu = np.concatenate([[0], np.cumsum(lens)])
    starts = packed_chunk_start_states(q, k, v, g, beta, cu, init, 64)
    chunks = chunk_starts(lens, 64)
    assert chunks == [(0, 0), (0, 64), (0, 128), (1, 0), (2, 0)]
    for row, (sequence, before) in enumerate(chunks):
        rows = slice(cu[sequence], cu[sequence] + before)
        _, prefix = packed_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], [0, before], init[[sequence]]
        )
        np.testing.assert_array_equal(starts[row], prefix[0])


@pytest.mark.parametrize(
    ("family", "dtype"), [("kimi-linear", "fp32"), ("kimi-linear", "bf16"), ("glm5-next", "fp32")]
)
def test_kda_impl_passes_the_checkpoint_check(case_sets, family: str, dtype: str) -> None:
    runner = check_runner(case_sets[family, dtype], KDAImplAdapter)
    result = runner.run(CheckSpec(CASE_ID, dtype, CHECKPOINTS))
    comparison = result.comparison
    assert comparison.passed, comparison.verdict
    assert result.sides.actual.shape == (5, 2, 64, 64)  # the chunks of SEQ_LENS, heads, key, value
    assert comparison.attribution.source == CHECKPOINT_KERNEL_TRUTH_SOURCE
    assert comparison.judged_by == ("relative" if dtype == "bf16" else "absolute+relative")


def test_kda_impl_reads_them_from_its_chunk_program_and_refuses_others(case_sets) -> None:
    """The checkpoints come from the program `chunk_kernel` runs, compiled once for both; that program
    returns states every 32 tokens (plain JAX): checkpoints every 48 are not among them, a path it lacks
    (NotImplementedError: the check skips with the message)."""
    dumps = DumpSet(str(case_sets["kimi-linear", "fp32"]))
    case = dumps.case(CASE_ID)
    adapter = KDAImplAdapter(dumps.config, dict(dumps.weights()), "fp32", "naive")
    q, k, v, g, beta = (case.result(name, "fp32") for name in KERNEL_INPUTS)
    arguments = (l2norm(q), l2norm(k), v, g, beta, case.cu_seqlens, case.initial_state)
    adapter.chunk_kernel(*arguments)
    compiled = adapter._chunk._cache_size()  # the program is the process's: other tests may have run it
    h = adapter.chunk_kernel_checkpoints(*arguments, 64)
    assert h.shape == (5, 2, 64, 64) and adapter._chunk._cache_size() == compiled
    np.testing.assert_array_equal(h[[0, 3, 4]], case.initial_state)  # each sequence's first checkpoint
    with pytest.raises(
        NotImplementedError, match=r"returns its states every 32 tokens: no checkpoints every 48"
    ):
        adapter.chunk_kernel_checkpoints(*arguments, 48)


def test_checkpoints_one_chunk_late_fail_it_as_a_state_defect_of_the_kernel(case_sets) -> None:
    runner = check_runner(case_sets["kimi-linear", "fp32"], CheckpointOneChunkLate)
    assert not runner.run(CheckSpec(CASE_ID, "fp32", CHECKPOINTS)).comparison.passed
    stages = {row.check: row for row in run_stages(runner, CASE_ID, "fp32")}
    kernel = ("kernel-chunk", "kernel-chunk-state", "kernel-recurrent", "kernel-recurrent-state")
    assert {check: stages[check].comparison.passed for check in kernel} == dict.fromkeys(kernel, True)
    assert stages["kernel-chunk-checkpoints"].key == "chunk_checkpoints"
    defects = [(row.check, what) for row, what in state_defects(list(stages.values()))]
    assert defects == [
        ("kernel-chunk-checkpoints", "the chunk kernel's checkpoints (its state entering every chunk)")
    ]


def _doc_block(heading: str) -> str:
    """The first python block of docs/adapters.md after `heading`."""
    text = ADAPTERS_DOC.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


def test_the_skeleton_of_the_docs_passes_it(case_sets) -> None:
    """docs/adapters.md's checkpoint skeleton, on its minimal adapter, as written."""
    namespace: dict = {"__name__": "my_adapter"}
    for heading in ("## A minimal adapter", "## The chunk kernel's checkpoints"):
        exec(compile(_doc_block(heading), str(ADAPTERS_DOC), "exec"), namespace)
    adapter_class = namespace["MyCheckpointAdapter"]
    for dtype in ("fp32", "bf16"):
        runner = check_runner(case_sets["kimi-linear", dtype], adapter_class)
        comparison = runner.run(CheckSpec(CASE_ID, dtype, CHECKPOINTS)).comparison
        assert comparison.passed, comparison.verdict


def test_an_adapter_without_the_protocol_skips_it_with_the_reason(case_sets) -> None:
    runner = check_runner(case_sets["kimi-linear", "fp32"], KernelOnlyAdapter)
    reason = (
        "adapter 'numpy kernels only' implements no checkpoint-kernel protocol "
        "(conformance.adapter.CheckpointKernelAdapter)"
    )
    assert unprovided(KernelOnlyAdapter, CHECKPOINTS.kind.needs) == reason  # skipped when the run is planned
    with pytest.raises(CheckSkipped, match=r"no checkpoint-kernel protocol"):  # and never called
        runner.run(CheckSpec(CASE_ID, "fp32", CHECKPOINTS))
