"""A kernel-only adapter is a supported adapter: a run of it on golden checks its kernels, skips every
other check when the run is planned (with the reason, listed before any check runs), and exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.checks import kinds
from conformance.checks.serving_scenarios import fixed_scenarios, write_scenarios

REPO = Path(__file__).resolve().parents[2]
IMPL = "tests.conformance.kernel_only_adapter:KernelOnlyAdapter"
NO_LAYER = "adapter 'numpy kernels only' implements no layer protocol (conformance.adapter.LayerAdapter)"
NO_SERVING = "no serving protocol (conformance.adapter.ServingAdapter)"
NO_RAW_GATE = (
    "adapter 'numpy kernels only' implements no raw-gate-kernel protocol "
    "(conformance.adapter.RawGateKernelAdapter)"
)
NO_CHECKPOINTS = (
    "adapter 'numpy kernels only' implements no checkpoint-kernel protocol "
    "(conformance.adapter.CheckpointKernelAdapter)"
)
NO_GRADIENTS = (
    "adapter 'numpy kernels only' implements no gradient protocol (conformance.adapter.GradientAdapter)"
)
NO_LAYER_GRADIENTS = (
    "adapter 'numpy kernels only' implements no layer-gradient protocol "
    "(conformance.adapter.LayerGradientAdapter)"
)
# what a kernel-only adapter passes: the kernel checks, and the chunk kernel's causality
KERNEL_CHECKS = {kind.name() for kind in kinds.KERNEL_KINDS} | {kinds.KERNEL_CHUNK_CAUSAL.name()}
GRADIENT_CHECKS = {
    *(kinds.Check(kinds.KERNEL_CHUNK_GRAD, name).name for name in kinds.GRADIENT_INPUTS),
    kinds.KERNEL_CHUNK_GRAD_H0.name(),
    kinds.KERNEL_CHUNK_GRAD_CAUSAL.name(),
}
LAYER_GRADIENT_CHECKS = {
    kinds.LAYER_GRAD_X.name(),
    kinds.LAYER_GRAD_H0.name(),
    *(kinds.Check(kinds.LAYER_GRAD_WEIGHT, name).name for name in kinds.LAYER_GRADIENT_WEIGHTS),
    kinds.LAYER_GRAD_CAUSAL.name(),
}
RAW_GATE_CHECKS = {kind.name() for kind in kinds.RAW_GATE_KERNEL_KINDS}
CHECKPOINT_CHECK = kinds.KERNEL_CHUNK_CHECKPOINTS.name()


def _run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "conformance", "run", "--impl", IMPL, "--dtypes", "fp32", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def kernel_only_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, subprocess.CompletedProcess]:
    """One case of golden and one serving scenario, fp32."""
    folder = tmp_path_factory.mktemp("kernel-only")
    scenarios = folder / "scenarios.json"
    write_scenarios(fixed_scenarios()[:1], scenarios)
    result = _run("--cases", "T8", "--scenarios", str(scenarios), "--report-dir", str(folder / "reports"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((folder / "reports" / "report.json").read_text()), result


def test_a_kernel_only_run_passes_its_kernels_and_skips_the_rest_with_the_reason(
    kernel_only_run: tuple[dict, subprocess.CompletedProcess],
) -> None:
    report, _ = kernel_only_run
    checks = {check["check"]: check for check in report["checks"]}
    assert {check["status"] for name, check in checks.items() if name in KERNEL_CHECKS} == {"passed"}
    assert set(checks) >= KERNEL_CHECKS
    others = {name: check for name, check in checks.items() if name not in KERNEL_CHECKS}
    assert {check["status"] for check in others.values()} == {"skipped"}
    groups = {kinds.parse_check(name).kind.group for name in others}
    assert {"layer", "intermediate", "decode", "chunked", kinds.TRAINING_GROUP, kinds.SERVING_GROUP} <= groups
    for name, check in others.items():
        kind = kinds.parse_check(name).kind
        if kind.group == kinds.SERVING_GROUP:
            assert NO_SERVING in check["message"], check
        elif name in RAW_GATE_CHECKS:
            assert check["message"] == NO_RAW_GATE, check
        elif name == CHECKPOINT_CHECK:
            assert check["message"] == NO_CHECKPOINTS, check
        elif name in GRADIENT_CHECKS:
            assert check["message"] == NO_GRADIENTS, check
        elif name in LAYER_GRADIENT_CHECKS:
            assert check["message"] == NO_LAYER_GRADIENTS, check
        else:
            assert check["message"] == NO_LAYER, check


def test_the_plan_summary_lists_the_skips_before_any_check_runs(
    kernel_only_run: tuple[dict, subprocess.CompletedProcess],
) -> None:
    report, result = kernel_only_run
    lines = result.stdout.splitlines()
    planned, skipped = len(report["checks"]), report["summary"]["skipped"]
    header = lines.index(f"plan: {planned} checks, {skipped} skipped before they run:")
    reasons = lines[header + 1 : header + 8]
    assert any(line.endswith(f" skipped: {NO_LAYER}") for line in reasons), reasons
    assert any(line.endswith(f"{len(RAW_GATE_CHECKS)} skipped: {NO_RAW_GATE}") for line in reasons), reasons
    assert any(line.endswith(f"1 skipped: {NO_CHECKPOINTS}") for line in reasons), reasons
    assert any(line.endswith(f"{len(GRADIENT_CHECKS)} skipped: {NO_GRADIENTS}") for line in reasons), reasons
    assert any(
        line.endswith(f"{len(LAYER_GRADIENT_CHECKS)} skipped: {NO_LAYER_GRADIENTS}") for line in reasons
    ), reasons
    assert any(NO_SERVING in line for line in reasons), reasons
    assert sum(int(line.split()[0]) for line in reasons if line.startswith("  ")) == skipped
    first_check = next(i for i, line in enumerate(lines) if "test_conformance.py" in line)
    assert header < first_check, lines[: header + 5]


def test_a_kernel_only_run_of_layer_checks_alone_checked_nothing() -> None:
    result = _run("--cases", "T8", "-k", "layer")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    # layer, layer-state, layer-kernel-state, layer-causal, and the 18 layer gradient and causality checks
    assert "error: nothing was checked: all 22 checks were skipped" in result.stderr, result.stderr
    assert NO_LAYER in result.stderr
