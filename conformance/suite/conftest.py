"""pytest wiring of the suite: options, one test per planned check, records, the final table."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from conformance.adapters.guard import EXIT_IMPLEMENTATION, ImplementationFault, one_line
from conformance.checks.catalogue import CheckSpec
from conformance.dumps.reader import DumpError
from conformance.reports.render import terminal_lines
from conformance.suite.options import add_implementation_options, add_selection_options, suite_options
from conformance.suite.session import ConformanceSession, ProvidedSession

SESSION = pytest.StashKey[ConformanceSession]()
FINAL_REPORT = pytest.StashKey[dict[str, Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "KDA conformance")
    group.addoption("--dumps", metavar="DIR_OR_URL", help="the dump set to check against (required)")
    add_implementation_options(group.addoption)
    add_selection_options(group.addoption)
    group.addoption("--report-dir", metavar="DIR", help="write report.json and report.md here")


def pytest_configure(config: pytest.Config) -> None:
    provided = next((p for p in config.pluginmanager.get_plugins() if isinstance(p, ProvidedSession)), None)
    if provided is not None:  # the command line opened the dump set and built the implementation
        config.stash[SESSION] = provided.session
        return
    if not config.getoption("--dumps"):
        raise pytest.UsageError("the conformance suite needs --dumps DIR_OR_URL")
    report_dir = config.getoption("--report-dir")
    try:
        options = suite_options(config.getoption, Path(report_dir) if report_dir else None)
        config.stash[SESSION] = ConformanceSession(options)
    except (DumpError, ValueError) as err:
        raise pytest.UsageError(str(err)) from None


def pytest_sessionstart(session: pytest.Session) -> None:
    conformance = session.config.stash[SESSION]
    conformance.install_signal_handlers()
    if conformance.runner.adapters:
        return
    try:
        conformance.build_implementation()
    except ImplementationFault as fault:
        conformance.write_reports()
        pytest.exit(fault.message, returncode=EXIT_IMPLEMENTATION)


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[SESSION].planned = sum(
        isinstance(getattr(item, "callspec", None) and item.callspec.params.get("spec"), CheckSpec)
        for item in session.items
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "spec" in metafunc.fixturenames:
        specs = metafunc.config.stash[SESSION].specs
        metafunc.parametrize("spec", specs, ids=[spec.id for spec in specs])


@pytest.fixture(scope="session")
def conformance(request: pytest.FixtureRequest) -> ConformanceSession:
    return request.config.stash[SESSION]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, Any]:
    """Record each check's outcome: the call's, or a setup phase that did not pass."""
    report = yield
    spec = getattr(item, "callspec", None) and item.callspec.params.get("spec")
    if not isinstance(spec, CheckSpec) or (report.when != "call" and report.passed):
        return report
    session = item.config.stash[SESSION]
    if report.passed:
        status, message = "passed", session.comparisons[spec.id].summary()
    elif report.skipped:
        status, message = "skipped", str(call.excinfo.value) if call.excinfo else str(report.longrepr)
    elif call.excinfo is not None and not call.excinfo.errisinstance(pytest.fail.Exception):
        status, message = "error", session.checker_error(call.excinfo)
    else:
        status = "failed" if report.when == "call" else "error"
        message = (call.excinfo.exconly() if call.excinfo else report.longreprtext).removeprefix("Failed: ")
    session.record(spec, status, one_line(message, 400), report.duration)
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if SESSION not in session.config.stash:
        return
    conformance = session.config.stash[SESSION]
    conformance.restore_signal_handlers()
    conformance.finish(exitstatus == pytest.ExitCode.INTERRUPTED, bool(session.shouldfail))
    session.config.stash[FINAL_REPORT] = conformance.write_reports()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if FINAL_REPORT not in config.stash:
        return
    conformance = config.stash[SESSION]
    terminalreporter.section("KDA conformance")
    for line in terminal_lines(config.stash[FINAL_REPORT]):
        terminalreporter.write_line(line)
    if conformance.options.report_dir:
        terminalreporter.write_line(f"reports written to {conformance.options.report_dir}/")
