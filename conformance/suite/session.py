"""State of one suite run: the dump set, the runner, the record of every check, and how the run ended."""

from __future__ import annotations

import signal
import time
import traceback
from types import FrameType
from typing import Any

import pytest

from conformance.adapter import load_adapter_class, unprovided, unserved_family
from conformance.adapters.guard import CallWatchdog, FaultLog, ImplementationFault, one_line
from conformance.checks.catalogue import CheckSkipped, CheckSpec, plan
from conformance.checks.kinds import KINDS, SERVING_GROUP, CheckKind
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
from conformance.reports.report import Record, build_report, records_status
from conformance.reports.run_status import RunStatus, Stop, StopKind, check_status
from conformance.runtime.environment import environment
from conformance.suite.options import SuiteOptions

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_RECORD_MESSAGE_LIMIT = 400  # a record's message, on one line


class ConformanceSession:
    """Opens the dump set and the implementation, runs checks and keeps their records.

    `specs` is the run's plan: every check of the options' selection, narrowed to those pytest selected
    (`-k`, `-m`, `--deselect`) once it has collected them (`select`); `planned` is how many. A planned
    check whose kind needs a call of a protocol the adapter's class does not declare, or every check of
    a dump set whose family it does not serve (`unprovided`, by kind), is skipped with that reason when
    it runs, without a call; `plan_lines` says so before the
    first check. `stop` says how the run ended before running them all (an interrupt, a call timeout,
    an implementation that could not be built, `-x`), None while it has not. Every report says both.
    """

    def __init__(self, options: SuiteOptions, dumps: DumpSet | None = None):
        """`dumps`: the set at `options.dumps` already opened (and verified: its files then read once)."""
        self.options = options
        self.dumps = DumpSet(options.dumps) if dumps is None else dumps
        self.policy = TolerancePolicy.load(options.tolerances)
        adapter_class = load_adapter_class(options.impl)
        adapter_class.parse_options(options.impl_options)  # a bad option stops the run before any check
        self.watchdog = CallWatchdog(options.call_timeout_s, self._on_call_timeout)
        self.runner = CheckRunner(
            self.dumps, adapter_class, options.kernel, self.policy, options.impl_options, self.watchdog
        )
        self.dumps.weights()  # a broken weights file stops the run before any check
        scenarios = fixed_scenarios() if options.scenarios is None else load_scenarios(options.scenarios)
        self.serving = ServingChecks(self.runner, scenarios, scenario_set_name(options.scenarios))
        unserved = unserved_family(adapter_class, self.dumps.config)
        self.unprovided: dict[CheckKind, str] = {
            kind: reason
            for kind in KINDS
            if (reason := unserved or unprovided(adapter_class, kind.needs)) is not None
        }
        self.specs = plan(self.dumps, self.dumps.case_ids(options.cases), options.dtypes)
        if options.cases is None or options.scenarios is not None:  # --cases alone picks dump cases only
            self.specs += self.serving.plan(options.dtypes)
        self.records: list[Record] = []
        self.checker_errors: dict[str, str] = {}  # a bug of the checker itself: its traceback, once
        self.stop: Stop | None = None
        self.started = time.monotonic()
        self._current: CheckSpec | None = None
        self._signal: str | None = None
        self._previous_handlers: dict[int, Any] = {}

    @property
    def faults(self) -> FaultLog:
        return self.runner.calls.faults

    @property
    def planned(self) -> int:
        return len(self.specs)

    def select(self, specs: list[CheckSpec]) -> None:
        """The plan narrowed to the checks pytest collected and selected."""
        self.specs = specs

    def plan_lines(self) -> list[str]:
        """The plan in short, for the terminal before the first check: how many checks, and how many of
        them will be skipped for a protocol the adapter does not declare, one line per reason."""
        reasons = [self.unprovided[spec.kind] for spec in self.specs if spec.kind in self.unprovided]
        lines = [
            f"plan: {self.planned} checks, {len(reasons)} skipped before they run" + (":" if reasons else "")
        ]
        counts = {reason: reasons.count(reason) for reason in dict.fromkeys(reasons)}
        return lines + [f"  {count} skipped: {reason}" for reason, count in counts.items()]

    def build_implementation(self) -> None:
        """Build the implementation of every planned dtype before any check runs; an
        `ImplementationFault` (the adapter's constructor raised) is the end of the run."""
        for dtype in dict.fromkeys(spec.dtype for spec in self.specs):
            try:
                self.runner.calls.adapter(dtype)
            except ImplementationFault as fault:
                self.stop = Stop(StopKind.NOT_BUILT, fault.message)
                raise

    # ----------------------------------------------------------------------------------------- checks

    def check(self, spec: CheckSpec) -> None:
        """Run one check and record its outcome, then end its test as pytest must count it: a check
        that cannot run skips with the reason; one out of tolerance, or that the implementation faulted
        in, fails with its one line; a bug of the checker raises on as it is."""
        self._current = spec
        started = time.monotonic()
        try:
            result = self.result(spec)
        except CheckSkipped as skip:
            self.record(spec, str(skip), time.monotonic() - started, skipped=True)
            pytest.skip(str(skip))
        except ImplementationFault as fault:
            self.faults.add_check(fault, spec.id)
            self.record(spec, fault.message, time.monotonic() - started)
            pytest.fail(fault.message, pytrace=False)
        except Exception as err:
            self.record(spec, self.checker_error(err), time.monotonic() - started)
            raise
        finally:
            self._current = None
        comparison = result.comparison
        message = summary(comparison) if comparison.passed else self.failure_text(spec, comparison)
        self.record(spec, message, time.monotonic() - started, comparison)
        if not comparison.passed:
            pytest.fail(message, pytrace=False)

    def result(self, spec: CheckSpec) -> CheckResult:
        """One check computed and decided; `CheckSkipped` when it cannot run: at once, without a call,
        for a check that needs a protocol the adapter does not declare."""
        reason = self.unprovided.get(spec.kind)
        if reason is not None:
            raise CheckSkipped(reason)
        return self.serving.run(spec) if spec.group == SERVING_GROUP else self.runner.run(spec)

    def failure_text(self, spec: CheckSpec, comparison: Comparison) -> str:
        """A failed check's one line: its summary, after a note first (so that no cut loses it) for an
        fp32 check whose absolute limits fail on a set whose fp32 reference may not be IEEE fp32."""
        note = self.dumps.reference_precision.failure_note
        if note and spec.dtype == "fp32" and comparison.absolute_failures:
            return f"{note}: {summary(comparison)}"
        return summary(comparison)

    def record(
        self,
        spec: CheckSpec,
        message: str,
        duration_s: float,
        comparison: Comparison | None = None,
        skipped: bool = False,
    ) -> None:
        """Record a check's outcome, its status as `check_status` decides it: skipped, its comparison's
        verdict, or an error where it has none."""
        status = check_status(comparison, skipped)
        self.records.append(
            Record(spec, status, one_line(message, _RECORD_MESSAGE_LIMIT), duration_s, comparison)
        )

    def has_record(self, spec: CheckSpec) -> bool:
        """Whether the last record is `spec`'s: its check recorded its outcome."""
        return bool(self.records) and self.records[-1].spec == spec

    def checker_error(self, err: BaseException) -> str:
        """A check that raised outside the implementation: a bug of the checker. Its traceback is kept
        once per distinct exception; the check's message is one line."""
        line = one_line("".join(traceback.format_exception_only(err)))
        self.checker_errors.setdefault(line, "".join(traceback.format_exception(err)))
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
        """Say how the run stopped early, if it did."""
        if self.stop is not None:
            return
        if interrupted:
            self.stop = Stop(StopKind.INTERRUPTED, self._signal or "KeyboardInterrupt")
        elif len(self.records) < self.planned:
            self.stop = Stop(StopKind.FIRST_FAILURE if exit_first else StopKind.EARLY)

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
            self.record(spec, fault.message, elapsed_s)
        self.stop = Stop(StopKind.CALL_TIMEOUT, fault.message)
        self.write_reports()
        folder = self.options.report_dir
        return (
            [f"the reports in {folder}/ are marked incomplete ({len(self.records)} of {self.planned} checks)"]
            if folder
            else []
        )

    def status(self) -> RunStatus:
        """Where the run stands so far: its verdict and exit code (`run_status`)."""
        return records_status(self.records, self.planned, bool(self.faults), self.stop)

    def nothing_checked(self, keyword: str | None) -> str:
        """Why a run whose status is `nothing_checked` compared nothing: no check selected (`-k
        keyword` matching none), or every check skipped."""
        if not self.planned:
            if keyword:
                return (
                    f"nothing was checked: -k {keyword!r} matches no check "
                    "(check ids read <case>-<dtype>-<check>, as T65-fp32-layer)"
                )
            return "nothing was checked: no check was selected"
        first = self.records[0]
        return (
            f"nothing was checked: all {len(self.records)} checks were skipped "
            f"(as {first.spec.id}: {first.message})"
        )

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
                "family": self.dumps.config.family,
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
        return build_report(self.records, meta, self.policy.close_margin, self.planned, self.stop)

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
