"""The suite's pytest hooks, bound to one opened `ConformanceSession`: one test per planned check, a
record of each outcome, the reports and the final table. `kda-conform run` hands them to its own pytest
run; the pytest plugin registers them in another repository's run (`plugin.py`)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from conformance.checks.catalogue import CheckSpec
from conformance.exit_codes import ExitCode
from conformance.reports.render import terminal_lines
from conformance.suite import SUITE_FILE
from conformance.suite.session import ConformanceSession

SESSION = pytest.StashKey[ConformanceSession]()


def _spec(item: pytest.Item) -> CheckSpec | None:
    """The check a test item runs, or None for any other test of the session."""
    spec = getattr(item, "callspec", None) and item.callspec.params.get("spec")
    return spec if isinstance(spec, CheckSpec) else None


class SuiteHooks:
    """A pytest plugin: the suite's tests of `session`'s checks. With `owns_exit_status` (the plugin in
    another repository's pytest) it also sets the run's exit status to the session's (`run_status`: 3
    an implementation fault, 2 an interrupt or nothing checked, 1 a check out of tolerance) wherever the
    checks do not hold, and leaves pytest's where they do; `kda-conform run` sets its exit status
    itself, from the same status."""

    def __init__(self, session: ConformanceSession, owns_exit_status: bool = False):
        self.session = session
        self.owns_exit_status = owns_exit_status
        self.final_report: dict[str, Any] | None = None
        self.nothing_checked: str | None = None

    def pytest_configure(self, config: pytest.Config) -> None:
        config.stash[SESSION] = self.session  # for the suite's fixture (test_conformance.py)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session.install_signal_handlers()

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "spec" in metafunc.fixturenames and Path(metafunc.definition.path).resolve() == SUITE_FILE:
            specs = self.session.specs
            metafunc.parametrize("spec", specs, ids=[spec.id for spec in specs])

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The plan narrowed to what pytest selected, and its summary (`plan_lines`) before any check."""
        self.session.select([spec for spec in map(_spec, session.items) if spec is not None])
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            for line in self.session.plan_lines():
                reporter.write_line(line)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo
    ) -> Generator[None, Any, Any]:
        """Record what the session's `check` did not see: a phase of pytest's around a check (its setup,
        its teardown) that did not pass, or a call pytest itself ended (a plugin's timeout); the check
        records its own outcome."""
        report = yield
        spec = _spec(item)
        if spec is None or report.passed or (report.when == "call" and self.session.has_record(spec)):
            return report
        excinfo = call.excinfo
        if excinfo is None:
            message = report.longreprtext
        elif report.skipped or excinfo.errisinstance(pytest.fail.Exception):
            message = str(excinfo.value)  # the reason pytest.skip or pytest.fail was given
        else:
            message = self.session.checker_error(excinfo.value)
        self.session.record(spec, message, report.duration, skipped=report.skipped)
        return report

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        conformance = self.session
        conformance.restore_signal_handlers()
        conformance.finish(exitstatus == pytest.ExitCode.INTERRUPTED, bool(session.shouldfail))
        self.final_report = conformance.write_reports()
        if not self.owns_exit_status:
            return
        status = conformance.status()
        if status.exit_code is ExitCode.OK:
            return
        if status.nothing_checked:
            self.nothing_checked = conformance.nothing_checked(session.config.getoption("keyword"))
        session.exitstatus = status.exit_code

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if self.final_report is None:
            return
        terminalreporter.section("KDA conformance")
        for line in terminal_lines(self.final_report):
            terminalreporter.write_line(line)
        if self.session.options.report_dir:
            terminalreporter.write_line(f"reports written to {self.session.options.report_dir}/")
        if self.nothing_checked:
            terminalreporter.write_line(f"error: {self.nothing_checked}")
