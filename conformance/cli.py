"""`python -m conformance {run,gate,diff,verify,power,search}` (docs/cli.md).

Exit codes (`conformance/exit_codes.py`): 0 all holds; 1 a check or stage out of tolerance, a gate
breach, or a search's finding; 2 a usage error, an unreadable or broken dump set or report, an
interrupted or incomplete run; 3 the implementation under test raised, timed out or broke the adapter
contract.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.adapter import (
    KERNEL_CHOICES,
    AdapterImportError,
    KDAAdapter,
    load_adapter_class,
    parse_option_pairs,
)
from conformance.adapters.guard import CallWatchdog, ImplementationFault, checked_call_timeout
from conformance.dumps.bundled import NoBundledSet, dumps_or_bundled
from conformance.dumps.reader import DumpError, DumpSet, open_verified
from conformance.exit_codes import ExitCode
from conformance.policy import DEFAULT_POLICY_FILE, TolerancePolicy, check_growth_factor
from conformance.reports.output_files import check_writable_file
from conformance.runtime.compile_cache import enable_compile_cache
from conformance.runtime.cpu_compile import prefer_fast_cpu_compile
from conformance.runtime.run_platform import REQUIRABLE_PLATFORMS
from conformance.suite import SUITE_FILE, SUITE_ROOT
from conformance.suite.options import add_implementation_options, add_selection_options, suite_options
from conformance.tools.gate import platform_breaches
from kda_spec.dump_format import DTYPES
from kda_spec.extras import MissingExtra, missing_extra, require

if TYPE_CHECKING:
    from conformance.suite.options import SuiteOptions


class UsageError(Exception):
    """Bad arguments or unusable input: one line for the user, exit 2."""


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """The block's ValueError (the user's input at fault, the message names it) as a `UsageError`."""
    try:
        yield
    except ValueError as err:
        raise UsageError(str(err)) from None


def _add_dumps_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dumps",
        metavar="DIR_OR_URL",
        help="the dump set (default: the golden set the package carries; golden-glm5-next: its "
        "glm5-next set)",
    )


def _add_impl_options(parser: argparse.ArgumentParser) -> None:
    add_implementation_options(parser.add_argument)
    parser.add_argument("--tp", metavar="N", help="kda_impl's tensor-parallel size: --impl-option tp=N")
    parser.add_argument("--dp", metavar="M", help="kda_impl's data-parallel size: --impl-option dp=M")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the conformance suite and write the reports")
    _add_dumps_option(run)
    _add_impl_options(run)
    add_selection_options(run.add_argument)
    run.add_argument("--report-dir", default="reports", metavar="DIR")
    run.add_argument("-k", dest="keyword", metavar="EXPR", help="only checks whose id matches (pytest -k)")
    run.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing check")
    run.add_argument(
        "pytest_args",
        nargs="*",
        metavar="-- PYTEST_OPTION",
        help="pytest's own options after `--` (e.g. -- -W ignore::DeprecationWarning)",
    )

    gate = commands.add_parser("gate", help="exit non-zero when a report breaches the policy")
    gate.add_argument("report", metavar="REPORT.json")
    gate.add_argument("--baseline", metavar="OLD_REPORT.json", help="fail where an error grew past it")
    gate.add_argument(
        "--growth-factor", type=float, help="allowed growth over the baseline (default: policy)"
    )
    gate.add_argument(
        "--allow-different-dumps",
        action="store_true",
        help="compare with a baseline made on another dump set (or one that records none)",
    )
    gate.add_argument("--tolerances", default=str(DEFAULT_POLICY_FILE), help="tolerance policy file")
    gate.add_argument(
        "--require-platform",
        choices=REQUIRABLE_PLATFORMS,
        help="fail a report made on another platform or with interpreted Pallas (default: the policy's "
        "[platform] require)",
    )

    diff = commands.add_parser("diff", help="errors stage by stage through the layer for one case")
    _add_dumps_option(diff)
    diff.add_argument("--case", required=True, metavar="ID")
    diff.add_argument("--dtype", default="fp32", choices=DTYPES)
    _add_impl_options(diff)
    diff.add_argument("--png", metavar="FILE", help="draw a stage's error over tokens × heads")
    diff.add_argument("--stage", metavar="RESULT", help="result to draw (default: first out of tolerance)")

    verify = commands.add_parser("verify", help="check a dump set's schema and checksums")
    _add_dumps_option(verify)

    power = commands.add_parser("power", help="the smallest injected defect the suite catches")
    _add_dumps_option(power)
    power.add_argument("--dtype", default="all", choices=(*DTYPES, "all"))
    power.add_argument("--cases", nargs="+", metavar="ID", help="case ids (default: each defect's own)")
    power.add_argument("--defects", nargs="+", metavar="PATTERN", help="defect ids or fnmatch patterns")
    power.add_argument("--kernel", default="auto", choices=KERNEL_CHOICES, help="the implementation's kernel")
    power.add_argument("--tolerances", default=str(DEFAULT_POLICY_FILE), help="tolerance policy file")
    power.add_argument("--report-dir", default="reports", metavar="DIR")

    search = commands.add_parser(
        "search", help="generate cases until one fails, shrink it, write it as a dump set"
    )
    weights = search.add_mutually_exclusive_group()
    weights.add_argument("--dumps", metavar="DIR_OR_URL", help="the config and weights of this dump set")
    weights.add_argument(
        "--preset", default="mini", help="else this preset's synthetic weights (default mini)"
    )
    _add_impl_options(search)
    search.add_argument("--dtypes", default="fp32", help="comma-separated subset of fp32,bf16 (default fp32)")
    search.add_argument("--budget", type=float, default=600.0, metavar="SECONDS", help="time to search (600)")
    search.add_argument("--seed", type=int, default=0, help="the draws' seed (and the synthetic weights')")
    search.add_argument(
        "--out", required=True, metavar="DIR", help="search.json and the reproducer/ dump set"
    )
    search.add_argument("--max-tokens", type=int, default=512, help="tokens per case at most (512)")
    search.add_argument("--max-seqs", type=int, default=6, help="sequences per case at most (6)")
    search.add_argument(
        "--shrink-budget", type=float, default=300.0, metavar="SECONDS", help="time to shrink a finding (300)"
    )
    search.add_argument("--no-progress", action="store_true", help="no progress bar")
    search.add_argument(
        "--space",
        default="cases",
        choices=("cases", "serving", "grad"),
        help="what to draw: dump cases (default), serving schedules (docs/serving.md), or dump cases judged "
        "by the gradient and causality checks (docs/gradients.md)",
    )
    return parser


def _policy(path: str) -> TolerancePolicy:
    with _usage_errors():
        return TolerancePolicy.load(path)


def cmd_verify(args: argparse.Namespace) -> int:
    dumps = open_verified(dumps_or_bundled(args.dumps))
    files = len(dumps.cases) + 2
    print(
        f"{dumps.label}: format v1, {len(dumps.cases)} cases, {files} files, every sha256 and key checked: ok"
    )
    return ExitCode.OK


def _impl_options(args: argparse.Namespace) -> dict[str, str]:
    """The adapter's options as given: `--impl-option`s, and `--tp`/`--dp` as `tp`/`dp`."""
    with _usage_errors():
        options = parse_option_pairs(args.impl_options)
        for key in ("tp", "dp"):
            shorthand = getattr(args, key)
            if shorthand is not None:
                if key in options:
                    raise ValueError(f"--{key} {shorthand} and --impl-option {key}={options[key]}: give one")
                options[key] = shorthand
    return options


def _adapter(args: argparse.Namespace) -> tuple[type[KDAAdapter], dict[str, str]]:
    """The adapter class of `--impl` and its options, checked by the adapter itself (`parse_options`).
    An adapter module that raises on import is an `AdapterImportError` (`main` makes it exit 3)."""
    options = _impl_options(args)
    with _usage_errors():
        adapter_class = load_adapter_class(args.impl)
        adapter_class.parse_options(options)
    return adapter_class, options


def _suite_options(args: argparse.Namespace, options: dict[str, str]) -> SuiteOptions:
    with _usage_errors():
        return suite_options(functools.partial(getattr, args), Path(args.report_dir), options)


def _call_timeout(args: argparse.Namespace) -> float:
    with _usage_errors():
        return checked_call_timeout(args.call_timeout)


def _implementation_fault(message: str, trace: str) -> int:
    """The implementation could not be imported or built: one `error:` line, its traceback once."""
    print(f"error: {message}", file=sys.stderr)
    print(trace.rstrip(), file=sys.stderr)
    return ExitCode.IMPLEMENTATION


def cmd_run(args: argparse.Namespace) -> int:
    import pytest

    from conformance.suite.hooks import SuiteHooks
    from conformance.suite.start import start_session

    try:
        with _usage_errors():
            session = start_session(_suite_options(args, _impl_options(args)))
    except ImplementationFault as fault:
        return _implementation_fault(fault.message, fault.traceback_text)
    pytest_args = [
        str(SUITE_FILE),
        "-c", os.devnull,  # the suite's behaviour does not depend on the pytest settings of the cwd
        f"--rootdir={SUITE_ROOT}",  # the test ids: conformance/suite/test_conformance.py::…
        "-p", "no:cacheprovider",
        "-rN",  # no short summary: the suite's own lists each check that did not hold
        "--tb=no",  # one line per check; the suite prints each distinct traceback once
    ]  # fmt: skip
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    if args.exitfirst:
        pytest_args.append("-x")
    pytest_args += args.pytest_args
    code = pytest.main(pytest_args, plugins=[SuiteHooks(session)])
    status = session.status()
    if status.exit_code is ExitCode.OK:  # the checks hold: pytest's own trouble (an internal error) is 2
        return ExitCode.OK if code == pytest.ExitCode.OK else ExitCode.USAGE
    if status.nothing_checked:
        raise UsageError(session.nothing_checked(args.keyword))
    return status.exit_code


def cmd_gate(args: argparse.Namespace) -> int:
    from conformance.tools.gate import ReportError, breaches, dump_set_mismatch, gate_status, load_report

    policy = _policy(args.tolerances)
    with _usage_errors():
        factor = policy.growth_factor
        if args.growth_factor is not None:
            factor = check_growth_factor(args.growth_factor, "--growth-factor")
    try:
        report = load_report(args.report)
        baseline = load_report(args.baseline) if args.baseline else None
        found = breaches(report, baseline, factor, policy.growth_min_ratio)
    except ReportError as err:
        raise UsageError(str(err)) from None
    required = args.require_platform or policy.require_platform
    if required:
        found += platform_breaches(report, required)
    mismatch = dump_set_mismatch(report, baseline) if baseline else None
    if mismatch and not args.allow_different_dumps:
        raise UsageError(
            f"{args.report} against {args.baseline}: {mismatch}; --allow-different-dumps to go on"
        )
    status = gate_status(report, found)
    totals = ", ".join(f"{count} {name}" for name, count in status.counts.items())
    if found:
        print(f"gate: FAIL ({len(found)} breach{'es' if len(found) > 1 else ''}; {totals})")
        for line in found:
            print(f"  {line}")
    else:
        against = f" against baseline {args.baseline} (growth ≤ ×{factor:g})" if baseline else ""
        on = f", made on {required}" if required else ""
        print(f"gate: ok ({totals}){on}{against}")
    return status.exit_code


def cmd_diff(args: argparse.Namespace) -> int:
    from conformance.checks.runner import CheckRunner
    from conformance.tools.diff import stage_to_look_at
    from conformance.tools.diff_case import case_lines, run_case
    from conformance.tools.diff_heatmap import draw_heatmap

    dumps = DumpSet(dumps_or_bundled(args.dumps))
    dumps.case_ids([args.case])  # names an unknown case
    if args.png:
        require("matplotlib", "diff --png")
        with _usage_errors():
            check_writable_file(Path(args.png), "--png")  # before the run, not after it
    adapter_class, options = _adapter(args)
    enable_compile_cache()
    watchdog = CallWatchdog(_call_timeout(args))
    runner = CheckRunner(dumps, adapter_class, args.kernel, _policy(args.tolerances), options, watchdog)
    if not runner.case(args.case).has_dtype(args.dtype):
        raise UsageError(f"case {args.case!r} of {dumps.label} has no {args.dtype} run")
    diff = run_case(runner, args.case, args.dtype)
    results = diff.stages
    print(f"{args.case} ({args.dtype}), implementation {args.impl}, kernel {args.kernel}")
    for line in case_lines(diff):
        print(line)
    if args.png:
        compared = {row.key: row for row in results if row.comparison is not None}
        look_at = stage_to_look_at(results)  # a state defect first, else the first out of tolerance
        name = args.stage or (look_at.key if look_at else "out")
        if name not in compared:
            raise UsageError(
                f"--stage {name!r}: no compared result of that name; choose from {list(compared)}"
            )
        title = f"{args.case} {args.dtype}: {compared[name].result}"
        try:
            draw_heatmap(compared[name], Path(args.png), title, runner.case(args.case).cu_seqlens)
        except OSError as err:
            raise UsageError(f"--png {args.png}: cannot write the heatmap ({err})") from None
        print(f"heatmap of {name} written to {args.png}")
    return diff.exit_code


def cmd_power(args: argparse.Namespace) -> int:
    from conformance.tools import power_report

    dumps, policy = open_verified(dumps_or_bundled(args.dumps)), _policy(args.tolerances)
    enable_compile_cache()
    with _usage_errors():
        result, missed = power_report.run(
            dumps, policy, dtype=args.dtype, cases=args.cases, defect_patterns=args.defects,
            kernel=args.kernel, report_dir=Path(args.report_dir), command=" ".join(sys.argv),
        )  # fmt: skip
    print("\n".join(power_report.terminal_lines(result)))
    print(f"power: reports in {args.report_dir}; goals " + ("met" if not missed else "MISSED:"))
    for reason in missed:
        print(f"  {reason}")
    return ExitCode.FAIL if missed else ExitCode.OK


def cmd_search(args: argparse.Namespace) -> int:
    from conformance.search.command import SearchOptions, run_search
    from conformance.search.judge import CHECKS, GRADIENT_CHECKS
    from conformance.search.serving_search import run_serving_search
    from conformance.suite.options import parse_dtypes

    adapter_class, options = _adapter(args)
    serving = args.space == "serving"
    dumps = dumps_or_bundled(args.dumps) if serving else args.dumps
    with _usage_errors():
        dtypes = tuple(parse_dtypes(args.dtypes))
        _check_positive(args, ("budget", "shrink_budget", "max_tokens", *(() if serving else ("max_seqs",))))
        if dumps is None:
            from kda_spec.config import get_preset

            get_preset(args.preset)
        else:
            open_verified(dumps)
    enable_compile_cache()
    search = SearchOptions(
        impl=args.impl, adapter_class=adapter_class, options=options, kernel=args.kernel,
        policy=_policy(args.tolerances), dumps=dumps, preset=args.preset, dtypes=dtypes,
        budget_s=args.budget, seed=args.seed, out=Path(args.out), max_tokens=args.max_tokens,
        max_seqs=args.max_seqs, shrink_budget_s=args.shrink_budget, progress=not args.no_progress,
        watchdog=CallWatchdog(_call_timeout(args)),
        checks=GRADIENT_CHECKS if args.space == "grad" else CHECKS,
    )  # fmt: skip
    try:
        return run_serving_search(search) if serving else run_search(search)
    except ImplementationFault as fault:  # the adapter's constructor failed
        return _implementation_fault(fault.message, fault.traceback_text)


def _check_positive(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """A ValueError naming the first of `flags` whose value is not > 0."""
    for flag in flags:
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")


COMMANDS = {
    "run": cmd_run,
    "gate": cmd_gate,
    "diff": cmd_diff,
    "verify": cmd_verify,
    "power": cmd_power,
    "search": cmd_search,
}


def find_adapters_in_cwd() -> None:
    """Let `--impl module:Attr` name a module of the current folder under `kda-conform` too, as under
    `python -m conformance`: a console script's sys.path starts at its own bin folder, not at the cwd.
    Appended, after the installed packages, so that no file of the folder hides one of them."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    find_adapters_in_cwd()
    prefer_fast_cpu_compile()  # before JAX starts: XLA reads $XLA_FLAGS once
    try:
        return COMMANDS[args.command](args)
    except (UsageError, DumpError, NoBundledSet, MissingExtra) as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    except ModuleNotFoundError as err:  # an optional dependency the command imports on its way
        missing = missing_extra(err, args.command)
        if missing is None:
            raise
        print(f"error: {missing}", file=sys.stderr)
        return ExitCode.USAGE
    except AdapterImportError as err:
        return _implementation_fault(str(err), err.traceback_text)
