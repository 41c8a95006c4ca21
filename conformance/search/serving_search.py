"""`python -m conformance search --space serving`: schedules drawn and judged until one fails, shrunk by
hypothesis to the fewest requests, steps and tokens, and written as a scenario file that `conformance
run --scenarios FILE` replays (docs/serving.md).

Each drawn schedule is run on the implementation's own pool and judged by every serving check
(`ServingChecks`: each request against itself alone and the float64 truth, the slots outside each batch,
bit for bit), on the dump's weights. Writes into `--out`: `scenarios.json` (the shrunk failing schedule,
when one was found) and `serving-search.json` (what was tried, what failed, how to replay it).
Exit status: 0 nothing failed within the budget, 1 a failing schedule was found, 2 the adapter has no
serving path (the search cannot answer).
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from conformance.adapter import provided_calls
from conformance.adapters.guard import ImplementationFault
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped
from conformance.checks.runner import CheckRunner
from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_scenarios import Scenario, write_scenarios
from conformance.dumps.reader import DumpSet
from conformance.exit_codes import ExitCode
from conformance.reports.check_record import summary
from conformance.reports.json_file import write_json
from conformance.search.command import SearchOptions, replay_command
from conformance.search.explore import Budget
from conformance.search.serving_space import schedule_strategy

SCENARIO_FILE = "scenarios.json"
REPORT_FILE = "serving-search.json"


class CannotAnswer(Exception):
    """The implementation has no serving path: the search has nothing to judge."""


class ScheduleJudge:
    """Whether a schedule fails a serving check, and the first failure of each schedule that does."""

    def __init__(self, options: SearchOptions, clock: Budget):
        dumps = DumpSet(options.dumps)
        self.runner = CheckRunner(
            dumps, options.adapter_class, options.kernel, options.policy, options.options, options.watchdog
        )
        self.dtypes, self.clock = options.dtypes, clock
        self.tried, self.failures = 0, {}

    def fails(self, scenario: Scenario) -> bool:
        """True when a serving check of `scenario` fails or the implementation faults on it; once the
        clock is spent every schedule counts as passing (the search and the shrinking stop)."""
        if scenario in self.failures:  # hypothesis replays what it found
            return True
        if self.clock.spent() or not scenario.forwards:
            return False
        self.tried += 1
        serving = ServingChecks(self.runner, [scenario], "searched")
        for spec in serving.plan(list(self.dtypes)):
            try:
                comparison = serving.run(spec).comparison
            except CheckSkipped as skip:
                if spec.kind == kinds.SERVING:  # the outputs' check: no serving path
                    raise CannotAnswer(str(skip)) from None
                continue  # a check this schedule does not give (no slot outside a batch)
            except ImplementationFault as fault:
                failure = fault.message
            else:
                if comparison.passed:
                    continue
                failure = summary(comparison)
            self.failures[scenario] = f"{spec.id}: {failure}"
            self.clock.found()
            return True
        return False


def run_serving_search(options: SearchOptions) -> int:
    """Search, shrink, write; the exit status (module docstring)."""
    clock = Budget(options.budget_s, options.shrink_budget_s)
    options.out.mkdir(parents=True, exist_ok=True)
    judge = ScheduleJudge(options, clock)
    found: Scenario | None = None
    cannot_answer: str | None = None
    try:
        found = _search(judge, options)
    except CannotAnswer as reason:
        cannot_answer = str(reason)
        print(f"nothing searched: {reason}")
    replay = replay_command(
        options, str(options.dumps), ",".join(options.dtypes),
        "--scenarios", str(options.out / SCENARIO_FILE), "--", "-k", "serving",
    )  # fmt: skip
    report: dict[str, Any] = {
        "space": "serving",
        "impl": options.impl,
        "dumps": options.dumps,
        "dtypes": list(options.dtypes),
        "seed": options.seed,
        "budget_s": options.budget_s,
        "duration_s": round(clock.elapsed(), 1),
        "schedules_tried": judge.tried,
        "cannot_answer": cannot_answer,
        "found": None,
    }
    if found is not None:
        report["found"] = {
            "failure": judge.failures[found],
            "size": _size(found),
            "scenario_file": SCENARIO_FILE,
            "replay": replay,
            "scenario": found.as_dict(),
        }
    write_json(report, options.out / REPORT_FILE)
    if cannot_answer is not None:
        return ExitCode.USAGE
    if found is None:
        print(f"serving search: {judge.tried} schedules, none failed ({clock.elapsed():.0f} s)")
        return ExitCode.OK
    write_scenarios([found], options.out / SCENARIO_FILE)
    print(f"serving search: failing schedule after {judge.tried} schedules: {judge.failures[found]}")
    print(f"shrunk to {_size(found)}; replay: {replay}")
    return ExitCode.FAIL


def _search(judge: ScheduleJudge, options: SearchOptions) -> Scenario | None:
    """hypothesis' `find`: draws until `judge.fails`, then shrinks within the shrink budget."""
    search_settings = settings(
        max_examples=10_000,
        deadline=None,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    try:
        return find(
            schedule_strategy(options.max_tokens, provided_calls(options.adapter_class)),
            judge.fails,
            settings=search_settings,
            random=random.Random(options.seed),
        )
    except NoSuchExample:
        return None


def _size(scenario: Scenario) -> str:
    tokens = scenario.request_tokens
    return (
        f"{len(tokens)} requests, {len(scenario.forwards)} forwards, {sum(tokens.values())} tokens, "
        f"{scenario.num_slots} slots"
    )
