"""The pytest plugin that runs fla's own KDA tests (tests/ops/test_kda.py of an fla checkout) on kda_impl.

After collection, the test module's fla kernel functions are replaced by `adapters` (kda_impl's kernels
under `--shim-kernel naive|pallas`): `chunk_kda`, `fused_recurrent_kda`, `fused_recurrent_kda_fwd` (vLLM's
slot-pool form, by `decode_kda_slots`) and `fused_kda_gate`. fla's references (`naive_*`) and its
`assert_close` stay fla's. Besides:

- `device` is "cpu" (fla.utils reports "cuda" on a host without a GPU; the tests would put the tensors
  there), and the module's `torch.device(...)` gives the CPU device (test_fused_recurrent_vllm_decode
  hard-codes "cuda"); the skip marks of the tests that need a GPU only for fla's own kernels (the vLLM
  decode, FlashKDA's CUDA backend) are removed, so they run on kda_impl. The NPU backend-routing test
  stays skipped: it checks fla's dispatch to its Ascend kernels, which has no kda_impl counterpart.
- fla's tests/conftest.py is not loaded (`__main__`): its autouse fixture guards torch.empty for fla's
  own kernels and synchronises fla's device, CUDA by fla.utils' account, absent here.
- Backward checks are out of scope: `assert_close` on a gradient (`GRADIENT_CHECKS`) is not run and is
  counted per test; the forward checks of the same test run as written.

The terminal summary (and `--shim-report FILE`, JSON) counts each test as passed, failed, unsupported (an
`adapters.Unsupported`: an fla option kda_impl does not have) or skipped (with its reason), and says which
passed tests are reference-only (no kda_impl call: fla's references against each other).
"""

from __future__ import annotations

import json
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fla_shim import adapters

TEST_FILE = "test_kda.py"
REPLACED = ("chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "fused_kda_gate")
GRADIENT_CHECKS = frozenset({"dq", "dk", "dv", "dg", "db", "db_raw", "dA", "dbias", "dh0"})
# Skip marks removed: what they wait for is fla's own GPU kernels, which the adapters replace.
GPU_ONLY_SKIPS = ("requires CUDA or NPU", "FlashKDA backend requires GPU")


class CpuTorch(types.ModuleType):
    """torch, except that `torch.device(...)` is the CPU device."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def device(*args: Any, **kwargs: Any) -> torch.device:
        return torch.device("cpu")


class Shim:
    """The plugin's state: what each test did and how it ended."""

    def __init__(self, kernel: str, report: str | None) -> None:
        self.kernel, self.report = kernel, report
        self.patched: set[int] = set()
        self.current = ""
        self.kernel_calls: Counter[str] = Counter()
        self.skipped_checks: dict[str, list[str]] = {}
        self.outcomes: dict[str, tuple[str, str]] = {}  # test id -> (outcome, reason)

    def patch_module(self, module: types.ModuleType) -> None:
        if id(module) in self.patched:
            return
        self.patched.add(id(module))
        fla_assert_close = module.assert_close
        for name in REPLACED:
            setattr(module, name, self.counted(name, getattr(adapters, name)))

        def assert_close(prefix: str, ref: Any, tri: Any, ratio: float, *args: Any, **kwargs: Any) -> None:
            if prefix in GRADIENT_CHECKS:
                self.skipped_checks.setdefault(self.current, []).append(prefix)
                return
            fla_assert_close(prefix, ref, tri, ratio, *args, **kwargs)

        module.assert_close = assert_close
        module.device = "cpu"
        module.torch = CpuTorch("torch")

    def counted(self, name: str, adapter: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.kernel_calls[self.current] += 1
            return adapter(*args, **kwargs)

        return call

    def record(self, report: pytest.TestReport, call: pytest.CallInfo | None) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.outcomes[report.nodeid] = ("skipped", reason)
            elif report.failed and call is not None and call.excinfo.errisinstance(adapters.Unsupported):
                self.outcomes[report.nodeid] = ("unsupported", str(call.excinfo.value))
            elif report.failed:
                self.outcomes[report.nodeid] = ("failed", report.longreprtext.strip().splitlines()[-1])
            else:
                self.outcomes[report.nodeid] = ("passed", "")
        elif report.when == "teardown" and report.failed:
            self.outcomes[report.nodeid] = (
                "failed",
                "teardown: " + report.longreprtext.strip().splitlines()[-1],
            )

    def summary(self) -> dict[str, Any]:
        counts = Counter(outcome for outcome, _ in self.outcomes.values())
        by_test = {
            nodeid.split("::")[-1]: {
                "outcome": outcome,
                "reason": reason,
                "kernel_calls": self.kernel_calls[nodeid],
                "backward_checks_not_run": self.skipped_checks.get(nodeid, []),
            }
            for nodeid, (outcome, reason) in self.outcomes.items()
        }
        reference_only = [t for t, r in by_test.items() if r["outcome"] == "passed" and not r["kernel_calls"]]
        with_backward = [t for t, r in by_test.items() if r["backward_checks_not_run"]]
        return {
            "kernel": self.kernel,
            "run": counts["passed"] + counts["failed"] + counts["unsupported"],
            **{outcome: counts[outcome] for outcome in ("passed", "failed", "unsupported", "skipped")},
            "passed_reference_only": len(reference_only),
            "tests_with_backward_checks_not_run": len(with_backward),
            "tests": by_test,
        }


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fla-shim", "fla's KDA tests on kda_impl's kernels")
    group.addoption("--shim-kernel", default="naive", choices=("naive", "pallas"), help="kda_impl kernel")
    group.addoption("--shim-report", default=None, help="write the summary as JSON to this file")


def pytest_configure(config: pytest.Config) -> None:
    shim = Shim(config.getoption("--shim-kernel"), config.getoption("--shim-report"))
    adapters.KERNEL = shim.kernel
    config.stash[SHIM] = shim


SHIM = pytest.StashKey[Shim]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shim = config.stash[SHIM]
    for item in items:
        if Path(str(item.fspath)).name != TEST_FILE:
            continue
        shim.patch_module(item.module)
        item.own_markers = [
            mark
            for mark in item.own_markers
            if not (mark.name == "skipif" and any(s in mark.kwargs.get("reason", "") for s in GPU_ONLY_SKIPS))
        ]


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.config.stash[SHIM].current = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    item.config.stash[SHIM].record(outcome.get_result(), call)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    shim = config.stash[SHIM]
    summary = shim.summary()
    write = terminalreporter.write_line
    write("")
    write(f"fla's KDA tests on kda_impl ({summary['kernel']}):")
    outcomes = ("run", "passed", "failed", "unsupported", "skipped")
    write("  " + ", ".join(f"{key} {summary[key]}" for key in outcomes))
    write(f"  passed without a kda_impl call (fla's references only): {summary['passed_reference_only']}")
    backward = summary["tests_with_backward_checks_not_run"]
    write(f"  tests whose backward checks were not run (forward only): {backward}")
    for test, result in summary["tests"].items():
        if result["outcome"] != "passed":
            write(f"  {result['outcome']:>11} {test}: {result['reason'][:200]}")
    if shim.report:
        Path(shim.report).write_text(json.dumps(summary, indent=1) + "\n")
