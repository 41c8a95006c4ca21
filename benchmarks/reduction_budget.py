"""How much of the fp32 rounding budget of a reduction each fp32 check uses, for the implementation and
the reference, against the float64 truth: the measurement behind `[relative.fp32]`'s lambdas
(docs/tolerance-policy.md, "The rounding budget of a reduction").

For every fp32 check of a dump set with a truth, in units of the check's budget `sqrt(K) · 2^-24`
(K: `conformance.checks.reductions`): the nRMSE against the truth (what `nrmse_lambda` must cover), and
the worst element's error over `sqrt(K) · 2^-24 · s_e` with `s_e` the RMS of the truth over the element's
head (what `margin_lambda` must cover). The table shows each check's worst over the cases.

    python -m benchmarks.reduction_budget --dumps DIR [--impl kda_impl]
"""

from __future__ import annotations

import argparse

import numpy as np

from conformance.adapter import load_adapter_class
from conformance.checks.catalogue import CheckSkipped, plan
from conformance.checks.kinds import parse_check
from conformance.checks.reductions import reduction_of
from conformance.checks.runner import CheckRunner
from conformance.checks.truth import NoTruth
from conformance.dumps.reader import DumpSet
from conformance.judging.reduction import head_scale
from conformance.policy import TolerancePolicy
from conformance.reports.tables import format_text_table

COLUMNS = ("nRMSE impl", "nRMSE ref", "worst element impl", "worst element ref")


def budget_units(runner: CheckRunner, dumps: DumpSet) -> dict[str, list[float]]:
    """Each fp32 check's worst, over the cases, of `COLUMNS` (module docstring)."""
    worst: dict[str, list[float]] = {}
    for spec in plan(dumps, list(dumps.cases), ["fp32"]):
        case = runner.case(spec.case_id)
        try:
            sides = runner.sides(case, spec)
            truth, _ = runner.truth(case, spec, sides)
        except (CheckSkipped, NoTruth):
            continue
        t = np.asarray(truth, np.float64)
        budget = reduction_of(spec.kind, dumps.config).budget
        scale = head_scale(t, sides.axes.index("head") if "head" in sides.axes else None)
        row = []
        for side in (sides.actual, sides.expected):
            error = np.abs(np.asarray(side, np.float64) - t)
            row.append(float(np.linalg.norm(error) / np.linalg.norm(t)) / budget)
        for side in (sides.actual, sides.expected):
            error = np.abs(np.asarray(side, np.float64) - t)
            row.append(float(np.max(error / (budget * np.maximum(scale, np.finfo(np.float64).tiny)))))
        worst[spec.check] = [max(a, b) for a, b in zip(worst.get(spec.check, row), row, strict=True)]
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dumps", required=True)
    parser.add_argument("--impl", default="kda_impl")
    args = parser.parse_args()
    dumps = DumpSet(args.dumps)
    runner = CheckRunner(dumps, load_adapter_class(args.impl), "auto", TolerancePolicy.load())
    worst = budget_units(runner, dumps)
    body = [
        [
            check,
            str(reduction_of(parse_check(check).kind, dumps.config).length),
            *(f"{v:.3g}" for v in values),
        ]
        for check, values in worst.items()
    ]
    print("\n".join(format_text_table(["check", "K", *COLUMNS], body)))
    print(
        "units: sqrt(K)·2^-24 (nRMSE against the truth), "
        "and that times the head's RMS of the truth (worst element)"
    )


if __name__ == "__main__":
    main()
