"""pytest wiring of the suite: options, one test per planned check, records, the final table."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from conformance.adapter import parse_option_pairs
from conformance.checks import CheckSpec
from conformance.reader import DumpError
from conformance.report import terminal_lines
from conformance.suite.session import ConformanceSession, SuiteOptions, parse_dtypes
from conformance.tolerances import DEFAULT_POLICY_FILE

SESSION = pytest.StashKey[ConformanceSession]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "KDA conformance")
    group.addoption("--dumps", metavar="DIR_OR_URL", help="the dump set to check against (required)")
    group.addoption("--impl", default="kda_impl", help="built-in adapter name or package.module:Attr")
    group.addoption("--kernel", default="auto", choices=("auto", "naive", "pallas"))
    group.addoption(
        "--impl-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the adapter, passed to its constructor (repeatable)",
    )
    group.addoption("--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    group.addoption("--cases", nargs="+", metavar="ID", help="case ids (default: every case of the set)")
    group.addoption("--report-dir", metavar="DIR", help="write report.json and report.md here")
    group.addoption("--tolerances", default=str(DEFAULT_POLICY_FILE), help="the tolerance policy file")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--dumps"):
        raise pytest.UsageError("the conformance suite needs --dumps DIR_OR_URL")
    report_dir = config.getoption("--report-dir")
    try:
        options = SuiteOptions(
            dumps=config.getoption("--dumps"),
            impl=config.getoption("--impl"),
            kernel=config.getoption("--kernel"),
            dtypes=parse_dtypes(config.getoption("--dtypes")),
            cases=config.getoption("--cases"),
            report_dir=Path(report_dir) if report_dir else None,
            tolerances=Path(config.getoption("--tolerances")),
            impl_options=parse_option_pairs(config.getoption("--impl-option")),
        )
        config.stash[SESSION] = ConformanceSession(options)
    except (DumpError, ValueError) as err:
        raise pytest.UsageError(str(err)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "spec" in metafunc.fixturenames:
        specs = metafunc.config.stash[SESSION].specs
        metafunc.parametrize("spec", specs, ids=[spec.id for spec in specs])


@pytest.fixture(scope="session")
def conformance(request: pytest.FixtureRequest) -> ConformanceSession:
    return request.config.stash[SESSION]


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
    else:
        status = "failed" if report.when == "call" else "error"
        message = (call.excinfo.exconly() if call.excinfo else report.longreprtext).removeprefix("Failed: ")
    session.record(spec, status, _one_line(message), report.duration)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    if SESSION in session.config.stash:
        session.config.stash[SESSION].write_reports()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if SESSION not in config.stash:
        return
    conformance = config.stash[SESSION]
    terminalreporter.section("KDA conformance")
    for line in terminal_lines(conformance.report()):
        terminalreporter.write_line(line)
    if conformance.options.report_dir:
        terminalreporter.write_line(f"reports written to {conformance.options.report_dir}/")
