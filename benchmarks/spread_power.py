"""What the reductions' spread costs and what `layer-kernel-state` catches (docs/tolerance-policy.md, "The
reductions' spread"): on the search's first fp32 cases of a seed's draw, the layer's final state of the
implementation, and the same state times `1 + 2·its own error` (the defect of issue 49: a relative gain
error of twice the implementation's own nRMSE against the truth), each judged by `layer-state` without
the spread, with it, and by `layer-kernel-state`. The defect is applied to the implementation's arrays,
as `tests.conformance.broken_adapters.state_scaled` applies it to the layer's result.

    python -m benchmarks.spread_power [--cases 80] [--seed 3] [--impl kda_impl] [--preset mini]

Prints one line per distinct case as it goes, then the table of them (the ratios to each limit, > 1
fails) and the counts.
"""

from __future__ import annotations

import argparse
import dataclasses

import fsspec
import numpy as np
from hypothesis import HealthCheck, given, settings

from conformance.adapter import load_adapter_class
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.judging.attribution import TruthError, error_vs_truth, relative_criteria
from conformance.judging.limits import RelativeLimits
from conformance.judging.verdict import decide
from conformance.policy import TolerancePolicy
from conformance.reports.tables import format_text_table
from conformance.search.dumpcase import CASE_ID
from conformance.search.judge import MEMORY_ROOT, Judge
from conformance.search.space import SearchCase, case_strategy
from conformance.search.weight_sets import weight_sets

STATE, KERNEL_STATE = Check(kinds.LAYER_STATE), Check(kinds.LAYER_KERNEL_STATE)
COLUMNS = (
    "case", "roundings", "impl: state before", "after", "kernel-state",
    "defect: state before", "after", "kernel-state",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Ratios:
    """One check's ratios to its limits: the implementation's and the defect's, without and with the
    spread (`layer-kernel-state` has none: both are the same there)."""

    impl_before: float
    impl_after: float
    defect_before: float
    defect_after: float
    roundings: float


def drawn_cases(strategy, count: int) -> list[SearchCase]:
    """The first `count` cases hypothesis draws from `strategy` (derandomized: the same every run),
    without repeats."""
    found: list[SearchCase] = []

    @settings(max_examples=count, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case: SearchCase) -> None:
        found.append(case)

    collect()
    return list(dict.fromkeys(found))


def ratios(runner: CheckRunner, check: Check, own_error: float | None) -> tuple[Ratios, float]:
    """`check` on the runner's case: the implementation and the defect (its state times
    `1 + 2·own_error`; the implementation's own `layer-state` nRMSE when `own_error` is None), and that
    own error."""
    spec = CheckSpec(CASE_ID, "fp32", check)
    case = runner.case(CASE_ID)
    sides = runner.sides(case, spec)
    truth, _ = runner.truth(case, spec, sides)
    tolerance = runner.policy.tolerance(spec.check, "fp32")
    after = runner.relative_limits(case, spec, tolerance, truth, sides)
    before = dataclasses.replace(after, spread=None)
    impl = error_vs_truth(sides.actual, truth, tolerance)
    reference = error_vs_truth(sides.expected, truth, tolerance)
    own = impl.nrmse if own_error is None else own_error
    defect = error_vs_truth(np.asarray(sides.actual, np.float64) * (1 + 2 * own), truth, tolerance)

    def ratio(side: TruthError, limits: RelativeLimits) -> float:
        return decide("relative", relative_criteria(side, reference, limits)).ratio()

    roundings = after.spread.roundings if after.spread else float("nan")
    found = Ratios(
        ratio(impl, before), ratio(impl, after), ratio(defect, before), ratio(defect, after), roundings
    )
    return found, own


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=80, help="cases to draw (repeats are judged once)")
    parser.add_argument("--seed", type=int, default=3, help="the search's seed: its weights and draw")
    parser.add_argument("--impl", default="kda_impl")
    parser.add_argument("--preset", default="mini")
    args = parser.parse_args(argv)
    adapter_class = load_adapter_class(args.impl)
    sets = weight_sets(None, args.preset, args.seed, adapter_class.FAMILIES)
    judge = Judge(adapter_class, "auto", {}, TolerancePolicy.load(), sets)
    rows, results = [], []
    for index, case in enumerate(drawn_cases(case_strategy(("fp32",), list(sets)), args.cases)):
        url = f"{MEMORY_ROOT}/spread-power/{index}"
        judge.write(case, url, {})
        try:
            runner = judge.runner(url, case)
            state, own = ratios(runner, STATE, None)
            kernel_state, _ = ratios(runner, KERNEL_STATE, own)
        finally:
            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
        results.append((state, kernel_state))
        rows.append([
            case.describe(), f"{state.roundings:.3g}",
            *(f"{r:.2f}" for r in (state.impl_before, state.impl_after, kernel_state.impl_after,
                                   state.defect_before, state.defect_after, kernel_state.defect_after)),
        ])  # fmt: skip
        print(f"[{index + 1}] " + "  ".join(rows[-1]), flush=True)
    print("\n".join(format_text_table(list(COLUMNS), rows)))
    print("\n".join(format_text_table(["", "count"], summary_rows(results))))
    return 0


def summary_rows(results: list[tuple[Ratios, Ratios]]) -> list[list[str]]:
    """The counts over the cases' (`layer-state`, `layer-kernel-state`) ratios: failures of the
    implementation and of the defect, before and after, and the defects no check catches after."""
    states, kernel_states = [s for s, _ in results], [k for _, k in results]

    def failing(values: list[float]) -> int:
        return sum(value > 1 for value in values)

    caught_before = [s.defect_before > 1 for s in states]
    caught_after = [s.defect_after > 1 or k.defect_after > 1 for s, k in results]
    missed = [max(s.defect_after, k.defect_after) for (s, k), c in zip(results, caught_after) if not c]
    impl_kernel = [k.impl_after for k in kernel_states]
    return [
        ["cases", str(len(results))],
        ["the implementation fails layer-state, before / after",
         f"{failing([s.impl_before for s in states])} / {failing([s.impl_after for s in states])}"],
        ["the implementation fails layer-kernel-state (worst ratio)",
         f"{failing(impl_kernel)} ({max(impl_kernel, default=0):.2f})"],
        ["defect fails layer-state, before / after",
         f"{sum(caught_before)} / {failing([s.defect_after for s in states])}"],
        ["defect fails layer-kernel-state", str(failing([k.defect_after for k in kernel_states]))],
        ["defect caught before, by neither after",
         str(sum(before and not after for before, after in zip(caught_before, caught_after)))],
        ["defect caught by neither after (its worst ratio)", f"{len(missed)} ({max(missed, default=0):.2f})"],
    ]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
