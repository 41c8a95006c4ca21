"""The pytest plugin (entry point `pytest11`: kda_conformance): the conformance suite inside another
repository's own pytest run.

    pytest --kda-impl my_pkg.adapter:Mine [--kda-dumps DIR_OR_URL] [--kda-dtypes fp32] [-k T65]

collects one test per check beside that repository's tests, with the ids, reports and exit status of
`kda-conform run` (docs/adapters.md). Without `--kda-impl` the plugin only adds its options: it
collects nothing, imports no more than the options' definitions (numpy, ml_dtypes), and changes
nothing of the run.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from conformance.exit_codes import ExitCode
from conformance.suite.options import add_implementation_options, add_selection_options

if TYPE_CHECKING:
    from conformance.suite.session import ConformanceSession

PREFIX = "kda-"  # every option of the plugin: --kda-impl, --kda-dumps, …
DEFAULT_REPORT_DIR = "reports/kda-conformance"  # a folder of its own: a run clears its report files


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kda-conformance", "KDA conformance (the suite runs only with --kda-impl)")
    add_implementation_options(group.addoption, PREFIX, default_impl=None)
    group.addoption(
        f"--{PREFIX}dumps",
        dest="kda_dumps",
        metavar="DIR_OR_URL",
        help="the dump set (default: the golden set the package carries; golden-glm5-next: its "
        "glm5-next set)",
    )
    add_selection_options(group.addoption, PREFIX)
    group.addoption(
        f"--{PREFIX}report-dir",
        dest="kda_report_dir",
        default=DEFAULT_REPORT_DIR,
        metavar="DIR",
        help=f"report.json, report.md and junit.xml of the conformance checks (default {DEFAULT_REPORT_DIR})",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("kda_impl") is None:
        return  # inert
    if getattr(config, "workerinput", None) is not None or config.getoption("numprocesses", None):
        _stop(ExitCode.USAGE, "--kda-impl runs the suite in one process: add -p no:xdist (or -n 0)")
    from conformance.suite.hooks import SuiteHooks

    session = _start(config)
    config.pluginmanager.register(SuiteHooks(session, owns_exit_status=True), "kda-conformance-suite")
    config.pluginmanager.register(SuiteCollector(), "kda-conformance-collector")


def _start(config: pytest.Config) -> ConformanceSession:
    """The opened session of the options given, as `kda-conform run` opens it; a run that cannot start
    stops pytest with run's exit status and one line (an implementation that cannot be imported or
    built: its traceback too)."""
    from conformance.adapter import AdapterImportError
    from conformance.adapters.guard import ImplementationFault
    from conformance.dumps.reader import DumpError
    from conformance.runtime.cpu_compile import prefer_fast_cpu_compile
    from conformance.suite.options import suite_options
    from conformance.suite.start import start_session
    from kda_spec.extras import MissingExtra

    prefer_fast_cpu_compile()  # as kda-conform run; nothing once JAX has started its backends
    get = functools.partial(_option, config)
    try:
        return start_session(suite_options(get, Path(get("report_dir"))))
    except (ValueError, DumpError, MissingExtra) as err:
        _stop(ExitCode.USAGE, str(err))
    except AdapterImportError as err:
        _stop(ExitCode.IMPLEMENTATION, str(err), err.traceback_text)
    except ImplementationFault as fault:
        _stop(ExitCode.IMPLEMENTATION, fault.message, fault.traceback_text)


def _option(config: pytest.Config, name: str) -> Any:
    return config.getoption(f"{PREFIX.replace('-', '_')}{name}")


def _stop(code: ExitCode, message: str, trace: str | None = None) -> NoReturn:
    if trace:
        print(trace.rstrip(), file=sys.stderr)
    pytest.exit(f"kda-conformance: {message}", returncode=code)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The suite's file is collected by `SuiteCollector` alone (with --kda-impl), never as a test file of
    a folder pytest walks: its tests exist only for a session."""
    from conformance.suite import SUITE_FILE

    return True if collection_path.resolve() == SUITE_FILE else None


class SuiteCollector:
    """Adds the suite's tests after the repository's own, before `-k`, `-m` and `--deselect` select."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        from conformance.suite import SUITE_FILE, SUITE_NODE_PATH

        # The id `kda-conform run` gives it, wherever the package lies from this repository's rootdir.
        module = pytest.Module.from_parent(session, path=SUITE_FILE, nodeid=SUITE_NODE_PATH)
        items.extend(session.genitems(module))
