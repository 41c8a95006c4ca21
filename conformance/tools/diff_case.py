"""`conformance diff` of one case and dtype: the stage table, every other check of the case, and each
failing check that can be followed call by call.

The checks are the case's own, as `run` plans them (`catalogue.plan`: `case_checks`, or a long case's
`long_case_checks`). A check the stage table shows (`diff.STAGES`) is decided there; every other one
(the decode checks, a long case's by-position checks, any kind added to the catalogue) is decided here
as `run` decides it (`CheckRunner.run`), so that diff never says a case holds while one of its checks
fails. A failing check whose kind is in `diff_steps.WALKS` (decode, chunked prefill) is followed call by
call to the call where it departs, with that call's own stage table; a failing bf16 stage or call is
named with the contract's rounding point at its entry (`diff_contract`).
"""

from __future__ import annotations

import dataclasses

from conformance.adapters.guard import ImplementationFault
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec, plan
from conformance.checks.kinds import Check, parse_check
from conformance.checks.runner import CheckResult, CheckRunner
from conformance.exit_codes import ExitCode
from conformance.reports.check_record import summary
from conformance.reports.tables import format_text_table
from conformance.tools.diff import STAGES, StageResult, first_out_of_tolerance, run_stages, table_lines
from conformance.tools.diff_contract import contract_lines
from conformance.tools.diff_steps import StepWalk, step_lines, walk

# The checks the stage table shows.
IN_STAGE_TABLE = frozenset(parse_check(check) for _, _, check in STAGES if check is not None)


@dataclasses.dataclass
class OtherCheck:
    """A check of the case that the stage table does not show: decided (`checked`), skipped (why), or
    failed with an implementation fault (`error`)."""

    spec: CheckSpec
    checked: CheckResult | None = None
    skipped: str = ""
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) or (self.checked is not None and not self.checked.comparison.passed)


@dataclasses.dataclass
class CaseDiff:
    """One case's diff: its stages, its other checks, and the walk of each failing check that has one."""

    stages: list[StageResult]
    others: list[OtherCheck]
    walks: list[StepWalk]

    @property
    def failing_outside(self) -> list[str]:
        """The checks outside the stage table that fail."""
        return [other.spec.check for other in self.others if other.failed]

    @property
    def failed(self) -> bool:
        """A stage out of tolerance, or a check outside the stage table failing."""
        return first_out_of_tolerance(self.stages) is not None or bool(self.failing_outside)

    @property
    def exit_code(self) -> ExitCode:
        """IMPLEMENTATION when a check faulted, FAIL when one failed or a stage is out of tolerance."""
        if any(other.error for other in self.others):
            return ExitCode.IMPLEMENTATION
        return ExitCode.FAIL if self.failed else ExitCode.OK


def run_case(runner: CheckRunner, case_id: str, dtype: str) -> CaseDiff:
    """The stages of the case, its other checks decided, and the failing ones walked call by call (a
    walk of the same calls as an earlier one named in that one)."""
    stages = run_stages(runner, case_id, dtype)
    checks = plan(runner.dumps, [case_id], [dtype])
    others = [_decided(runner, spec) for spec in checks if spec.of not in IN_STAGE_TABLE]
    failing = {row.check for row in stages if row.comparison is not None and not row.comparison.passed}
    failing.update(other.spec.check for other in others if other.checked is not None and other.failed)
    walks = []
    for spec in checks:
        if spec.check in failing and not _walked_against_the_dump(spec, failing):
            walked = walk(runner, spec)
            earlier = next((w for w in walks if walked is not None and w.runs_as(walked)), None)
            if earlier is not None:
                earlier.same_run.append(spec.check)
            elif walked is not None:
                walks.append(walked)
    return CaseDiff(stages, others, walks)


def _walked_against_the_dump(spec: CheckSpec, failing: set[str]) -> bool:
    """A `-self` decode check whose run also fails against the dump: that one's walk says what its
    would, against the dump's results instead of the implementation's own prefill."""
    return spec.kind is kinds.DECODE_SELF and Check(kinds.DECODE, spec.of.arg).name in failing


def _decided(runner: CheckRunner, spec: CheckSpec) -> OtherCheck:
    """One check decided as `run` decides it; skipped, or its fault, where it cannot be."""
    try:
        return OtherCheck(spec, runner.run(spec))
    except CheckSkipped as skip:
        return OtherCheck(spec, skipped=str(skip))
    except ImplementationFault as fault:
        return OtherCheck(spec, error=str(fault).splitlines()[0])


def case_lines(diff: CaseDiff) -> list[str]:
    """What diff prints for the case: the stage table and its findings, the contract's rounding point
    where a stage departs from its model, the other checks, and each walk with its call's stage table."""
    lines = table_lines(diff.stages, diff.failing_outside) + contract_lines(diff.stages)
    if diff.others:
        lines += ["", "the case's checks outside the stage table:"]
        table = format_text_table(["check", "verdict", ""], _other_rows(diff.others))
        lines += ["  " + line for line in table]
    for walked in diff.walks:
        lines += ["", *step_lines(walked)]
        if walked.stages:
            lines.append(f"the stages at {walked.named.label}, against {walked.reference}:")
            stage_table = table_lines(walked.stages) + contract_lines(walked.stages)
            lines += ["  " + line for line in stage_table]
    return lines


def _other_rows(others: list[OtherCheck]) -> list[list[str]]:
    rows = []
    for other in others:
        if other.error:
            rows.append([other.spec.check, "ERROR", other.error])
        elif other.checked is None:
            rows.append([other.spec.check, "skip", other.skipped])
        else:
            comparison = other.checked.comparison
            rows.append([other.spec.check, "ok" if comparison.passed else "OUT", summary(comparison)])
    return rows
