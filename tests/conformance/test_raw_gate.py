"""The kernels' raw-gate form (issue 42): the `kernel-*-rawgate[-state]` checks feed an adapter's
`RawGateKernelAdapter` calls the dumped raw gate `g_raw` with `A_log`, `dt_bias` and the family's L, and
judge them as the kernel checks. kda_impl passes them in both families and runs; a raw-gate form that
forgets dt_bias or the lower bound fails them, and `diff` names the raw-gate kernel as the first stage
out of tolerance; an adapter without the form, and a set without `g_raw`, skip them with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.adapter import unprovided
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import RAW_GATE_KERNEL_TRUTH_SOURCE, CheckRunner
from conformance.search.dumpcase import CASE_ID
from conformance.tools.diff import first_out_of_tolerance, run_stages
from tests.conformance.family_case_sets import BOTH_RUNS_AND_GLM, check_runner, write_case_sets
from tests.conformance.kernel_only_adapter import KernelOnlyAdapter
from tests.conformance.raw_gate_adapters import RawGateSoftplusEverywhere, RawGateWithoutDtBias
from tests.conformance.synthetic import write_dump_set

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
RAW_GATE_CHECKS = [Check(kind) for kind in kinds.RAW_GATE_KERNEL_KINDS]


@pytest.fixture(scope="module")
def case_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """One-case sets (40 + 20 tokens) with g_raw, by (family, run)."""
    return write_case_sets(tmp_path_factory, BOTH_RUNS_AND_GLM, (40, 20))


def _passed(runner: CheckRunner, dtype: str) -> dict[str, bool]:
    """Each raw-gate check of the set's case: whether it passed."""
    return {
        check.name: runner.run(CheckSpec(CASE_ID, dtype, check)).comparison.passed
        for check in RAW_GATE_CHECKS
    }


@pytest.mark.parametrize(
    ("family", "dtype"), [("kimi-linear", "fp32"), ("kimi-linear", "bf16"), ("glm5-next", "fp32")]
)
def test_kda_impl_passes_the_raw_gate_checks(case_sets, family: str, dtype: str) -> None:
    runner = check_runner(case_sets[family, dtype], KDAImplAdapter)
    for check in RAW_GATE_CHECKS:
        comparison = runner.run(CheckSpec(CASE_ID, dtype, check)).comparison
        assert comparison.passed, (check.name, comparison.verdict)
        assert comparison.attribution.source == RAW_GATE_KERNEL_TRUTH_SOURCE
        assert comparison.judged_by == ("relative" if dtype == "bf16" else "absolute+relative")


def test_a_raw_gate_form_without_dt_bias_fails_them_at_the_raw_gate_kernel(case_sets) -> None:
    runner = check_runner(case_sets["kimi-linear", "fp32"], RawGateWithoutDtBias)
    assert _passed(runner, "fp32") == {check.name: False for check in RAW_GATE_CHECKS}
    stages = run_stages(runner, CASE_ID, "fp32")
    first = first_out_of_tolerance(stages)
    assert first is not None and (first.stage, first.check) == ("kernel", "kernel-chunk-rawgate"), first
    assert first.key == "o_kda_chunk_rawgate"
    kernel_on_g = {
        row.check: row.comparison.passed for row in stages if row.check in ("kernel-chunk", "layer")
    }
    assert kernel_on_g == {"kernel-chunk": True, "layer": True}  # the layer and the kernels on g hold


def test_a_raw_gate_form_without_the_lower_bound_passes_kimi_and_fails_glm(case_sets) -> None:
    kimi = _passed(check_runner(case_sets["kimi-linear", "fp32"], RawGateSoftplusEverywhere), "fp32")
    assert all(kimi.values())
    glm = _passed(check_runner(case_sets["glm5-next", "fp32"], RawGateSoftplusEverywhere), "fp32")
    assert glm == {check.name: False for check in RAW_GATE_CHECKS}


def test_an_adapter_without_the_raw_gate_form_skips_them_with_the_reason(case_sets) -> None:
    runner = check_runner(case_sets["kimi-linear", "fp32"], KernelOnlyAdapter)
    reason = (
        "adapter 'numpy kernels only' implements no raw-gate-kernel protocol "
        "(conformance.adapter.RawGateKernelAdapter)"
    )
    for check in RAW_GATE_CHECKS:
        assert unprovided(KernelOnlyAdapter, check.kind.needs) == reason  # skipped when the run is planned
        with pytest.raises(CheckSkipped, match=r"no raw-gate-kernel protocol"):  # and never called
            runner.run(CheckSpec(CASE_ID, "fp32", check))
    assert runner.run(CheckSpec(CASE_ID, "fp32", Check(kinds.KERNEL_CHUNK))).comparison.passed


def test_a_set_without_g_raw_skips_them_with_the_reason(tmp_path: Path) -> None:
    """A format-v1 set written before the raw gate: the reader takes it, the raw-gate checks skip."""
    dumps = write_dump_set(tmp_path / "old", ("T8",), dtypes=("fp32",))
    runner = check_runner(dumps, KDAImplAdapter)
    for check in RAW_GATE_CHECKS:
        with pytest.raises(CheckSkipped, match=r"the dump has no \['g_raw'\]: the raw-gate kernel inputs"):
            runner.run(CheckSpec("T8", "fp32", check))
