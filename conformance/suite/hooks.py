"""The suite's pytest hooks, bound to one opened `ConformanceSession`: one test per planned check, a
record of each outcome, the reports and the final table. `kda-conform run` hands them to its own pytest
run; the pytest plugin registers them in another repository's run (`plugin.py`)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from conformance.adapters.guard import one_line
from conformance.checks.catalogue import CheckSpec
from conformance.reports.check_record import summary
from conformance.reports.render import terminal_lines
from conformance.suite import SUITE_FILE
from conformance.suite.session import EXIT_USAGE, ConformanceSession

SESSION = pytest.StashKey[ConformanceSession]()


def _spec(item: pytest.Item) -> CheckSpec | None:
    """The check a test item runs, or None for any other test of the session."""
    spec = getattr(item, "callspec", None) and item.callspec.params.get("spec")
    return spec if isinstance(spec, CheckSpec) else None


class SuiteHooks:
    """A pytest plugin: the suite's tests of `session`'s checks. With `owns_exit_status` (the plugin in
    another repository's pytest) it also sets the run's exit status as `kda-conform run` would (3 an
    implementation fault, 2 an interrupt or nothing checked, 1 a check out of tolerance) wherever the
    checks have a verdict; `kda-conform run` decides its exit status itself."""

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
        self.session.planned = sum(_spec(item) is not None for item in session.items)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo
    ) -> Generator[None, Any, Any]:
        """Record each check's outcome: the call's, or a setup phase that did not pass."""
        report = yield
        spec = _spec(item)
        if spec is None or (report.when != "call" and report.passed):
            return report
        session = self.session
        if report.passed:
            status, message = "passed", summary(session.results[spec.id].comparison)
        elif report.skipped:
            status, message = "skipped", str(call.excinfo.value) if call.excinfo else str(report.longrepr)
        elif call.excinfo is not None and not call.excinfo.errisinstance(pytest.fail.Exception):
            status, message = "error", session.checker_error(call.excinfo)
        else:
            status = "failed" if report.when == "call" else "error"
            text = call.excinfo.exconly() if call.excinfo else report.longreprtext
            message = text.removeprefix("Failed: ")
        session.record(spec, status, one_line(message, 400), report.duration)
        return report

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        conformance = self.session
        conformance.restore_signal_handlers()
        conformance.finish(exitstatus == pytest.ExitCode.INTERRUPTED, bool(session.shouldfail))
        self.final_report = conformance.write_reports()
        if not self.owns_exit_status:
            return
        verdict = conformance.exit_code(exitstatus)
        if verdict is None:
            keyword = session.config.getoption("keyword")
            self.nothing_checked = conformance.nothing_checked(exitstatus, keyword)
            verdict = EXIT_USAGE if self.nothing_checked else None
        if verdict is not None:
            session.exitstatus = verdict

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
