"""State of one suite run: the dump set, the runner, the record of every check, and how the run ended."""

from __future__ import annotations

import signal
import time
import traceback
from types import FrameType
from typing import Any

import pytest

from conformance.adapter import load_adapter_class
from conformance.adapters.guard import (
    EXIT_IMPLEMENTATION,
    CallWatchdog,
    FaultLog,
    ImplementationFault,
    one_line,
)
from conformance.checks.catalogue import CheckSkipped, CheckSpec, plan
from conformance.checks.kinds import SERVING_GROUP
from conformance.checks.runner import CheckResult, CheckRunner
from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_scenarios import fixed_scenarios, load_scenarios, scenario_set_name
from conformance.dumps.bundled import is_bundled
from conformance.dumps.reader import DumpSet
from conformance.judging.comparison import Comparison
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary
from conformance.reports.json_file import write_json
from conformance.reports.junit import write_junit
from conformance.reports.positions import write_files as write_position_files
from conformance.reports.render import markdown
from conformance.reports.report import Record, build_report
from conformance.runtime.environment import environment
from conformance.suite.options import SuiteOptions

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_FAIL, EXIT_USAGE = 1, 2  # docs/cli.md: a check out of tolerance; an interrupted run, nothing checked


class ConformanceSession:
    """Opens the dump set and the implementation, runs checks and keeps their records.

    `planned` is how many checks the run set out to run (after `-k`); `stopped` says why it ended before
    running them all (an interrupt, a call timeout, an implementation that could not be built, `-x`),
    None while it has not. Every report says both.
    """

    def __init__(self, options: SuiteOptions, dumps: DumpSet | None = None):
        """`dumps`: the set at `options.dumps` already opened (and verified: its files then read once)."""
        self.options = options
        self.dumps = DumpSet(options.dumps) if dumps is None else dumps
        self.policy = TolerancePolicy.load(options.tolerances)
        adapter_class = load_adapter_class(options.impl)
        adapter_class.parse_options(options.impl_options)  # a bad option stops the run before any check
        self.watchdog = CallWatchdog(options.call_timeout_s, EXIT_IMPLEMENTATION, self._on_call_timeout)
        self.runner = CheckRunner(
            self.dumps, adapter_class, options.kernel, self.policy, options.impl_options, self.watchdog
        )
        self.dumps.weights()  # a broken weights file stops the run before any check
        scenarios = fixed_scenarios() if options.scenarios is None else load_scenarios(options.scenarios)
        self.serving = ServingChecks(self.runner, scenarios, scenario_set_name(options.scenarios))
        self.specs = plan(self.dumps, self.dumps.case_ids(options.cases), options.dtypes)
        if options.cases is None or options.scenarios is not None:  # --cases alone picks dump cases only
            self.specs += self.serving.plan(options.dtypes)
        self.planned = len(self.specs)
        self.records: list[Record] = []
        self.results: dict[str, CheckResult] = {}
        self.checker_errors: dict[str, str] = {}  # a bug of the checker itself: its traceback, once
        self.stopped: str | None = None
        self.started = time.monotonic()
        self._current: CheckSpec | None = None
        self._signal: str | None = None
        self._previous_handlers: dict[int, Any] = {}

    @property
    def faults(self) -> FaultLog:
        return self.runner.calls.faults

    def build_implementation(self) -> None:
        """Build the implementation of every planned dtype before any check runs; an
        `ImplementationFault` (the adapter's constructor raised) is the end of the run."""
        for dtype in dict.fromkeys(spec.dtype for spec in self.specs):
            try:
                self.runner.calls.adapter(dtype)
            except ImplementationFault as fault:
                self.stopped = f"the implementation could not be built: {fault.message}"
                raise

    # ----------------------------------------------------------------------------------------- checks

    def check(self, spec: CheckSpec) -> CheckResult:
        """Run one check; a check that cannot run skips the test with the reason, one the implementation
        faulted in fails it with the fault's one line."""
        self._current = spec
        try:
            result = self.serving.run(spec) if spec.group == SERVING_GROUP else self.runner.run(spec)
        except CheckSkipped as skip:
            pytest.skip(str(skip))
        except ImplementationFault as fault:
            self.faults.add_check(fault, spec.id)
            pytest.fail(fault.message, pytrace=False)
        finally:
            self._current = None
        self.results[spec.id] = result
        return result

    def failure_text(self, spec: CheckSpec, comparison: Comparison) -> str:
        """A failed check's one line: its summary, after a note first (so that no cut loses it) for an
        fp32 check whose absolute limits fail on a set whose fp32 reference may not be IEEE fp32."""
        note = self.dumps.reference_precision.failure_note
        if note and spec.dtype == "fp32" and comparison.absolute_failures:
            return f"{note}: {summary(comparison)}"
        return summary(comparison)

    def record(self, spec: CheckSpec, status: str, message: str, duration_s: float) -> None:
        result = self.results.get(spec.id)
        if status == "failed" and result is None:
            status = "error"  # an exception, not a result out of tolerance
        self.records.append(Record(spec, status, message, duration_s, result and result.comparison))

    def checker_error(self, excinfo: pytest.ExceptionInfo[BaseException]) -> str:
        """A check that raised outside the implementation: a bug of the checker. Its traceback is kept
        once per distinct exception; the check's message is one line."""
        line = one_line(excinfo.exconly())
        self.checker_errors.setdefault(line, "".join(traceback.format_exception(excinfo.value)))
        return f"checker error (a bug of the conformance suite): {line}"

    # ------------------------------------------------------------------------------------ how it ends

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM stop the run as an interrupt (pytest's KeyboardInterrupt), so that the
        reports it writes say which signal and how far it got."""
        for signum in _STOP_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signal.Signals(signum).name
        raise KeyboardInterrupt(self._signal)

    def finish(self, interrupted: bool, exit_first: bool) -> None:
        """Say why the run stopped early, if it did."""
        if self.stopped is not None:
            return
        if interrupted:
            self.stopped = f"interrupted by {self._signal or 'KeyboardInterrupt'}"
        elif len(self.records) < self.planned:
            self.stopped = "stopped at the first failing check (-x)" if exit_first else "stopped early"

    def _on_call_timeout(self, call: str, elapsed_s: float) -> list[str]:
        """The watchdog's last act (from its thread, while the call is still stuck): the check in progress
        errs with the timeout, and the reports say where the run stopped."""
        fault = ImplementationFault(
            "timeout",
            call,
            f"did not return within {elapsed_s:.0f} s (--call-timeout {self.watchdog.timeout_s:g})",
        )
        self.faults.add_call(fault)
        spec = self._current
        if spec is not None:
            self.faults.add_check(fault, spec.id)
            self.records.append(Record(spec, "error", fault.message, elapsed_s, None))
        self.stopped = fault.message
        self.write_reports()
        folder = self.options.report_dir
        return (
            [f"the reports in {folder}/ are marked incomplete ({len(self.records)} of {self.planned} checks)"]
            if folder
            else []
        )

    def nothing_checked(self, pytest_code: int, keyword: str | None) -> str | None:
        """Why a finished run compared nothing (no check selected, or every check skipped), else None."""
        if pytest_code == pytest.ExitCode.NO_TESTS_COLLECTED or self.planned == 0:
            if keyword:
                return (
                    f"nothing was checked: -k {keyword!r} matches no check "
                    "(check ids read <case>-<dtype>-<check>, as T65-fp32-layer)"
                )
            return "nothing was checked: no check was selected"
        if self.records and all(record.status == "skipped" for record in self.records):
            first = self.records[0]
            return (
                f"nothing was checked: all {len(self.records)} checks were skipped "
                f"(as {first.spec.id}: {first.message})"
            )
        return None

    def exit_code(self, pytest_code: int) -> int | None:
        """The run's exit code (docs/cli.md): 3 when the implementation faulted, 2 when it was
        interrupted, 1 when a check is out of tolerance; None when nothing else is wrong (the caller
        still needs something checked for 0)."""
        if self.faults:
            return EXIT_IMPLEMENTATION
        if pytest_code == pytest.ExitCode.INTERRUPTED or (self.stopped or "").startswith("interrupted"):
            return EXIT_USAGE
        if any(record.status in ("failed", "error") for record in self.records):
            return EXIT_FAIL
        return None

    # ---------------------------------------------------------------------------------------- reports

    def report(self) -> dict[str, Any]:
        """The report of the run so far."""
        calls = self.runner.calls
        adapters = calls.adapters
        kernel_used = {dtype: adapter.kernel_used for dtype, adapter in adapters.items()}
        meta = {
            "duration_s": round(time.monotonic() - self.started, 2),
            "dumps": {
                "url": self.options.dumps,
                "label": self.dumps.label,  # golden (bundled, manifest sha256 …), or the URL and digest
                "bundled": is_bundled(self.options.dumps),
                "manifest_sha256": self.dumps.manifest_sha256,
                "manifest": self.dumps.manifest,
                "reference_precision": self.dumps.reference_precision.as_dict(),
            },
            "implementation": {
                "impl": self.options.impl,
                "name": next((adapter.name for adapter in adapters.values()), calls.adapter_class.name),
                "kernel": self.options.kernel,
                "options": self.options.impl_options,
                "kernel_used": kernel_used,
                "describe": {dtype: adapter.describe() for dtype, adapter in adapters.items()},
                "call_timeout_s": self.options.call_timeout_s,
            },
            "faults": self.faults.as_list(),
            "checker_errors": [
                {"message": line, "traceback": text} for line, text in self.checker_errors.items()
            ],
            "environment": environment(kernel_used),
            "tolerances": self.policy.as_dict(),
            "selection": {
                "cases": self.dumps.case_ids(self.options.cases),
                "dtypes": self.options.dtypes,
            },
        }
        return build_report(self.records, meta, self.policy.close_margin, self.planned, self.stopped)

    def write_reports(self) -> dict[str, Any]:
        """The report of the run so far, written as report.json, report.md and junit.xml into the report
        folder (when the run has one)."""
        report = self.report()
        folder = self.options.report_dir
        if folder is None:
            return report
        folder.mkdir(parents=True, exist_ok=True)
        write_json(report, folder / "report.json")
        write_junit(report, folder / "junit.xml")
        # The long cases' error by position: its files beside report.md, and a section at its end.
        by_position = write_position_files(list(self.runner.position_profiles.values()), folder)
        (folder / "report.md").write_text(markdown(report) + "\n".join(by_position))
        return report
