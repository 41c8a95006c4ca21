"""Everything a run does before its first check, for `kda-conform run` and the pytest plugin alike."""

from __future__ import annotations

from conformance.adapters.guard import ImplementationFault
from conformance.dumps.reader import open_verified
from conformance.reports.output_files import clear_report_dir
from conformance.runtime.compile_cache import enable_compile_cache
from conformance.suite.options import SuiteOptions
from conformance.suite.session import ConformanceSession


def start_session(options: SuiteOptions) -> ConformanceSession:
    """A session with its implementation built, in this order: the report folder emptied of the last
    run's reports, every file of the dump set checked, the policy read, the adapter imported and its
    options checked, JAX's compilation cache on, the implementation built for each dtype.

    Raises a ValueError for an unusable option, report folder, policy or case, a DumpError for a dump
    set that cannot be opened or is broken, a MissingExtra for a built-in adapter without its extra,
    an AdapterImportError when the adapter's module raised on import, and an ImplementationFault when
    its constructor raised (the reports are written first, marked incomplete).
    """
    if options.report_dir is not None:
        clear_report_dir(options.report_dir)  # first: the reports on disk are the last run's, or none
    dumps = open_verified(options.dumps)
    enable_compile_cache()
    session = ConformanceSession(options, dumps)
    try:
        session.build_implementation()
    except ImplementationFault:
        session.write_reports()
        raise
    return session
