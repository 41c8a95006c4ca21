"""The pytest plugin that runs fla's own KDA tests (tests/ops/test_kda.py of an fla checkout) on kda_impl.

After collection, the test module's fla kernel functions are replaced by `adapters` (kda_impl's kernels
under `--shim-kernel naive|pallas`, their backward by JAX's autodiff of the plain-JAX kernels under
either): `chunk_kda`, `fused_recurrent_kda`, `fused_recurrent_kda_fwd` (vLLM's slot-pool form, by
`decode_kda_slots`) and `fused_kda_gate`. fla's references (`naive_*`) and its `assert_close` stay fla's.
Besides:

- `device` is "cpu" (fla.utils reports "cuda" on a host without a GPU; the tests would put the tensors
  there), and the module's `torch.device(...)` gives the CPU device (test_fused_recurrent_vllm_decode
  hard-codes "cuda"); the skip marks of the tests that need a GPU only for fla's own kernels (the vLLM
  decode, FlashKDA's CUDA backend) are removed, so they run on kda_impl. The NPU backend-routing test
  stays skipped: it checks fla's dispatch to its Ascend kernels, which has no kda_impl counterpart.
- fla's tests/conftest.py is not loaded (`__main__`): its autouse fixture guards torch.empty for fla's
  own kernels and synchronises fla's device, CUDA by fla.utils' account, absent here.
- Every `assert_close` is counted, per test, as a forward check or a backward check (its name in
  `GRADIENT_CHECKS`), passed or failed. A failed check does not stop its test: the test's later checks
  run and are counted too, and the test fails at its end with every failed check's message. A check
  with `warning=True` (fla's dA checks) is counted by the assertion fla would make without it, and
  only warns, as in fla (it does not fail its test).

The terminal summary (and `--shim-report FILE`, JSON) counts each test as passed, failed, unsupported (an
`adapters.Unsupported`: an fla option kda_impl does not have) or skipped (with its reason), says which
passed tests are reference-only (no kda_impl call: fla's references against each other), and gives the
forward and the backward checks passed and failed, in all and per test.
"""

from __future__ import annotations

import json
import types
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
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
CHECKS_FAILED = "check(s) failed:"  # the message of a test failed by its checks, after their count


@dataclass(frozen=True)
class Check:
    """One `assert_close` call: its name, whether it compares a gradient, and fla's message if it failed."""

    name: str
    backward: bool
    failure: str = ""  # "" when it passed
    warning_only: bool = False  # `warning=True`: fla only warns when it fails


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
        self.checks: dict[str, list[Check]] = {}  # test id -> its assert_close calls, in order
        self.outcomes: dict[str, tuple[str, str]] = {}  # test id -> (outcome, reason)

    def patch_module(self, module: types.ModuleType) -> None:
        if id(module) in self.patched:
            return
        self.patched.add(id(module))
        fla_assert_close = module.assert_close
        for name in REPLACED:
            setattr(module, name, self.counted(name, getattr(adapters, name)))

        def assert_close(
            prefix: str, ref: Any, tri: Any, ratio: float, warning: bool = False, **kwargs: Any
        ) -> None:
            self.check(
                prefix, ratio, warning, lambda: fla_assert_close(prefix, ref, tri, ratio, False, **kwargs)
            )

        module.assert_close = assert_close
        module.device = "cpu"
        module.torch = CpuTorch("torch")

    def check(self, name: str, ratio: float, warning_only: bool, assertion: Callable[[], None]) -> None:
        """Run fla's `assertion` (its assert_close of limit `ratio`, without `warning`) and count it for the
        current test; a failure is kept for `failed_checks` (or, `warning_only`, only warned about, as fla
        does); an error other than an AssertionError is counted as a failure and raised."""
        checks = self.checks.setdefault(self.current, [])
        backward = name in GRADIENT_CHECKS
        try:
            assertion()
        except AssertionError as err:
            failure = f"{' '.join(str(err).split())} (limit {ratio})"
            checks.append(Check(name, backward, failure, warning_only))
            if warning_only:
                warnings.warn(failure, stacklevel=3)
            return
        except Exception as err:
            checks.append(Check(name, backward, f"{name}: {type(err).__name__}: {err}", warning_only))
            raise
        checks.append(Check(name, backward, "", warning_only))

    def failed_checks(self, nodeid: str) -> list[str]:
        """The failures of the test's checks that fail it (not the warning-only ones)."""
        return [c.failure for c in self.checks.get(nodeid, []) if c.failure and not c.warning_only]

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
            elif report.failed and call is not None and call.excinfo is not None:
                self.outcomes[report.nodeid] = ("failed", call.excinfo.exconly().strip().splitlines()[0])
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
                **check_counts(self.checks.get(nodeid, [])),
                "failed_checks": [
                    c.failure + (" (warning only)" if c.warning_only else "")
                    for c in self.checks.get(nodeid, [])
                    if c.failure
                ],
            }
            for nodeid, (outcome, reason) in self.outcomes.items()
        }
        reference_only = [t for t, r in by_test.items() if r["outcome"] == "passed" and not r["kernel_calls"]]
        every_check = [check for checks in self.checks.values() for check in checks]
        return {
            "kernel": self.kernel,
            "backward_by": "JAX's autodiff of the plain-JAX kernels"
            + (" (the Pallas kernels have none)" if self.kernel == "pallas" else ""),
            "run": counts["passed"] + counts["failed"] + counts["unsupported"],
            **{outcome: counts[outcome] for outcome in ("passed", "failed", "unsupported", "skipped")},
            "passed_reference_only": len(reference_only),
            **check_counts(every_check),
            "tests": by_test,
        }


def check_counts(checks: list[Check]) -> dict[str, Any]:
    """The forward and the backward checks among `checks` that passed and failed (the warning-only
    failures among the failed, counted apart too)."""
    counts: dict[str, Any] = {}
    for kind, backward in (("forward", False), ("backward", True)):
        own = [c for c in checks if c.backward == backward]
        failed = [c for c in own if c.failure]
        counts[f"{kind}_checks"] = {
            "passed": len(own) - len(failed),
            "failed": len(failed),
            "failed_warning_only": sum(c.warning_only for c in failed),
        }
    return counts


def describe_checks(counts: dict[str, Any]) -> str:
    """'forward checks: N passed, M failed; backward checks: ...' of `check_counts`."""
    parts = []
    for kind in ("forward", "backward"):
        c = counts[f"{kind}_checks"]
        warned = f" ({c['failed_warning_only']} warning only)" if c["failed_warning_only"] else ""
        parts.append(f"{kind} checks: {c['passed']} passed, {c['failed']} failed{warned}")
    return "; ".join(parts)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    failures = item.config.stash[SHIM].failed_checks(item.nodeid)
    if failures:
        raise AssertionError(f"{len(failures)} {CHECKS_FAILED} " + "; ".join(failures))
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    item.config.stash[SHIM].record(outcome.get_result(), call)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    shim = config.stash[SHIM]
    summary = shim.summary()
    write = terminalreporter.write_line
    write("")
    write(f"fla's KDA tests on kda_impl ({summary['kernel']}; backward: {summary['backward_by']}):")
    outcomes = ("run", "passed", "failed", "unsupported", "skipped")
    write("  tests: " + ", ".join(f"{key} {summary[key]}" for key in outcomes))
    write(f"  passed without a kda_impl call (fla's references only): {summary['passed_reference_only']}")
    write(f"  {describe_checks(summary)}")
    for test, result in summary["tests"].items():
        shown = result["reason"] and CHECKS_FAILED not in result["reason"]  # else the lines below say it
        reason = f": {result['reason'][:200]}" if shown else ""
        write(f"  {result['outcome']:>11} {test} ({describe_checks(result)}){reason}")
        for failure in result["failed_checks"]:
            write(f"{'':>14}{failure}")
    if shim.report:
        Path(shim.report).write_text(json.dumps(summary, indent=1) + "\n")
