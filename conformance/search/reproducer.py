"""The shrunk case as a reproducer: a format-v1 dump set on disk, replayed by the suite's own checks.

`write` puts the case in `<out>/reproducer/` (`dumpcase.py`: the plain fp32 pipeline its reference,
the float64 layer its truth). `replay` runs a check of it through a fresh `CheckRunner`, the adapter
built from the set's own weights as `conformance run --dumps <out>/reproducer` builds it; `builtin_failures`
runs every check `conformance run` makes of it on the built-in `kda_impl`: a reproducer that
implementation passes blames only the implementation under test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from conformance.adapter import KDAAdapter, load_adapter_class
from conformance.adapters.guard import ImplementationFault
from conformance.checks.catalogue import CheckSkipped, CheckSpec, plan
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary
from conformance.search.dumpcase import CASE_ID
from conformance.search.explore import Finding
from conformance.search.judge import Judge

REPRODUCER_DIR = "reproducer"


@dataclasses.dataclass(frozen=True)
class Replay:
    """One check of the reproducer as the suite judges it: `passed`, the truth `verdict` (impl,
    reference, both, conditioning, n/a; `fault` for an implementation fault) and its summary line."""

    check: str
    passed: bool
    verdict: str
    summary: str

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def write(judge: Judge, finding: Finding, out_dir: Path, impl: str) -> Path:
    """The finding's shrunk case as a dump set in `out_dir/reproducer` (replacing an earlier one)."""
    path = out_dir / REPRODUCER_DIR
    search = {"impl": impl, "check": finding.check, "first_found": finding.first.as_dict()}
    judge.write(finding.case, str(path), search, overwrite=True)
    return path


def replay(
    path: Path,
    adapter_class: type[KDAAdapter],
    kernel: str,
    options: Mapping[str, str],
    policy: TolerancePolicy,
    dtype: str,
    checks: list[str] | None = None,
) -> list[Replay]:
    """`checks` (default: every check `conformance run` makes) of the reproducer at `path` in `dtype`,
    judged by the suite, on a fresh adapter; a skipped check is left out."""
    runner = CheckRunner(DumpSet(str(path)), adapter_class, kernel, policy, options)
    specs = plan(runner.dumps, [CASE_ID], [dtype])
    replays = []
    for spec in specs if checks is None else [CheckSpec(CASE_ID, dtype, check) for check in checks]:
        try:
            comparison = runner.run(spec).comparison
        except CheckSkipped:
            continue
        except ImplementationFault as fault:
            replays.append(Replay(spec.check, False, "fault", fault.message))
            continue
        replays.append(Replay(spec.check, comparison.passed, comparison.blame, summary(comparison)))
    return replays


def builtin_failures(path: Path, kernel: str, policy: TolerancePolicy, dtype: str) -> list[Replay]:
    """The checks of the reproducer the built-in `kda_impl` fails (empty: a clean reproducer)."""
    builtin = load_adapter_class("kda_impl")
    return [r for r in replay(path, builtin, kernel, {}, policy, dtype) if not r.passed]
