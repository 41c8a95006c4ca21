"""`python -m conformance power`: the smallest injected defect the suite catches (docs/tolerance-policy.md,
"The suite's power").

Each defect is injected into the built-in implementation (`conformance.adapters.defects.DefectiveKDAImpl`) and
the suite's checks run in-process on a few cases that exercise it. A defect is *caught* under a policy
when at least one of those checks fails under it: `default`, the policy file as it is (the relative gate
where it decides), and `absolute`, the same file with every check judged by its absolute limits alone
(the RFC's 1e-5 in fp32, the measured 1e-2 + nRMSE gate in bf16).

An ε-defect is searched on the decade grid 1e-7 … 1e-1 (upwards, until both policies catch it; a defect
caught at ε is taken to be caught at every larger ε), then bisected `BISECT_STEPS` times in log space
between the last grid point not caught and the first caught, each midpoint rounded to two significant
digits: the result is within a factor 10^(1/8) ≈ 1.33 above the true threshold. A structural defect is
caught or not. Before any defect, the unmodified implementation runs every check used (ε = 0): a
check it fails there is reported (and the run misses its goals) and catches no defect.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from conformance.adapters.defects import BetaSigmoidInRunDtype, DefectiveKDAImpl, Injection
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec, case_checks
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from kda_spec import dump_format as fmt

POLICIES = ("default", "absolute")
GRID = tuple(10.0**exponent for exponent in range(-7, 0))
BISECT_STEPS = 3
# The largest ε at which every ε-defect must be caught under the default policy: a weight scaled by
# 1 + ε must be caught from 1e-4 in fp32 and 1e-2 in bf16, and so must every other ε-defect.
GOALS = {"fp32": 1e-4, "bf16": 1e-2}


_LAYER_GROUPS = frozenset({"layer", "intermediate", "decode", "chunked"})


def _any_case(seq_lens: tuple[int, ...]) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Defect:
    """One injected defect: `inject(weights, ε)` (ε-defects) or `inject(weights, 1.0)` (structural)."""

    id: str
    description: str
    structural: bool
    inject: Callable[[Mapping[str, np.ndarray], float], Injection]
    groups: frozenset[str] = _LAYER_GROUPS  # the check groups it can reach (kinds.GROUPS)
    preferred_cases: tuple[str, ...] = ("T65",)
    exercised_by: Callable[[tuple[int, ...]], bool] = _any_case
    layer_class: type = DefectiveKDAImpl.layer_class
    dtypes: tuple[str, ...] = fmt.DTYPES


def _on_weight(
    name: str, change: Callable[[np.ndarray, float], np.ndarray]
) -> Callable[[Mapping[str, np.ndarray], float], Injection]:
    """The injection of the weight `name` changed to `change(weight, ε)`."""
    return lambda weights, eps: Injection(weights={**weights, name: change(weights[name], eps)})


def defects(weight_names: list[str]) -> list[Defect]:
    """Every defect the command knows, the weight scales in the dump's order of `weight_names`."""
    return [
        *(
            Defect(
                id=f"scale:{name}",
                description=f"`{name}` scaled by 1 + ε",
                structural=False,
                inject=_on_weight(name, lambda weight, eps: weight * np.float32(1 + eps)),
            )
            for name in weight_names
        ),
        Defect(
            id="shift:A_log",
            description="the gate's `A_log` shifted by ε",
            structural=False,
            inject=_on_weight("A_log", lambda weight, eps: weight + np.float32(eps)),
        ),
        Defect(
            id="leak:state",
            description="packed prefill: each sequence starts from its initial state + ε × the previous "
            "sequence's final state",
            structural=False,
            inject=lambda weights, eps: Injection(state_leak=eps),
            groups=_LAYER_GROUPS | {"kernel"},
            preferred_cases=("varlen_initstate", "varlen_balanced_4x32"),
            exercised_by=lambda seq_lens: len(seq_lens) >= 2,
        ),
        Defect(
            id="drop:decode-conv",
            description="decode drops the conv state",
            structural=True,
            inject=lambda weights, eps: Injection(drop_decode_conv=True),
            groups=frozenset({"decode"}),
            preferred_cases=("T65", "varlen_initstate"),
            exercised_by=lambda seq_lens: max(seq_lens) >= 2,
        ),
        Defect(
            id="round:beta-sigmoid",
            description="one bf16 rounding moved: beta's sigmoid in bf16, not fp32",
            structural=True,
            inject=lambda weights, eps: Injection(),
            layer_class=BetaSigmoidInRunDtype,
            dtypes=("bf16",),
        ),
    ]


def select_defects(all_defects: list[Defect], patterns: list[str] | None) -> list[Defect]:
    """The defects whose id matches one of `patterns` (fnmatch; all when None); ValueError if none does."""
    if not patterns:
        return all_defects
    chosen = [d for d in all_defects if any(fnmatch.fnmatchcase(d.id, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"--defects {patterns}: matches none of {[d.id for d in all_defects]}")
    return chosen


def cases_for(defect: Defect, dumps: DumpSet, selected: list[str] | None) -> list[str]:
    """The cases `defect` runs on: the `selected` ones (`--cases`) that exercise it; without a
    selection its preferred cases the set has, else the set's first case that exercises it."""
    exercising = [c for c, info in dumps.cases.items() if defect.exercised_by(info.seq_lens)]
    if selected:
        return [c for c in selected if c in exercising]
    preferred = [c for c in defect.preferred_cases if c in exercising]
    return preferred or exercising[:1]


def _decodes_every_token(check: Check) -> bool:
    return check.kind in (kinds.DECODE, kinds.DECODE_SELF) and check.arg == "all"


def checks_for(defect: Defect, seq_lens: tuple[int, ...]) -> list[str]:
    """The checks of a case that `defect` can reach; decode-all is left out (one call per token; k = 1
    and k = 8 decode the same way), and so are the kernel checks unless the defect is in the kernel
    (they run on the dumped inputs, whatever the weights)."""
    return [
        check.name
        for check in case_checks(seq_lens)
        if check.kind.group in defect.groups and not _decodes_every_token(check)
    ]


@dataclasses.dataclass
class Outcome:
    """One point: the checks (`case:check`) that failed under each policy, and each compared check's
    ratio to the limit under each policy (the baseline's say how close to its limit a check that
    catches a defect already was without it)."""

    failed: dict[str, list[str]]
    ratios: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def caught(self, policy: str) -> bool:
        return bool(self.failed[policy])

    def caught_by(self, policy: str) -> str | None:
        return self.failed[policy][0] if self.failed[policy] else None


class PowerMeter:
    """Runs the checks of one dtype on a defect's cases with `DefectiveKDAImpl`, adapters cached."""

    def __init__(self, dumps: DumpSet, policy: TolerancePolicy, kernel: str):
        self.dumps = dumps
        self.runner = CheckRunner(dumps, DefectiveKDAImpl, kernel, policy)
        self.kernel = kernel
        self._adapters: dict[tuple[str, type], DefectiveKDAImpl] = {}
        # Per dtype, the checks the unmodified implementation already fails under each policy: a
        # defect is caught only by a check that holds without it.
        self.baseline: dict[str, Outcome] = {}

    def evaluate(
        self,
        dtype: str,
        injection: Injection,
        cases: Mapping[str, list[str]],
        layer_class: type = DefectiveKDAImpl.layer_class,
    ) -> Outcome:
        """Run the `cases` (case → checks) with `injection`; which checks fail under each policy, leaving
        out those `baseline[dtype]` fails. A check that raises (other than a skip) fails under both."""
        key = (dtype, layer_class)
        if key not in self._adapters:
            self._adapters[key] = DefectiveKDAImpl(
                self.dumps.config, self.dumps.weights(), dtype, self.kernel, layer_class=layer_class
            )
        adapter = self._adapters[key]
        adapter.inject(injection)
        self.runner.calls.use_adapter(dtype, adapter)
        self.runner.calls.forget_results()
        failed: dict[str, list[str]] = {policy: [] for policy in POLICIES}
        ratios: dict[str, dict[str, float]] = {policy: {} for policy in POLICIES}
        for case_id, checks in cases.items():
            for check in checks:
                name = f"{case_id}:{check}"
                try:
                    comparison = self.runner.run(CheckSpec(case_id, dtype, check)).comparison
                except CheckSkipped:
                    continue
                except Exception as err:  # an error fails the check, as in the suite
                    for policy in POLICIES:
                        failed[policy].append(f"{name} ({type(err).__name__})")
                    continue
                if comparison.failures:
                    failed["default"].append(name)
                if comparison.absolute_failures:
                    failed["absolute"].append(name)
                if comparison.usable:
                    ratios["default"][name] = comparison.gate_ratio
                    ratios["absolute"][name] = comparison.absolute_ratio
        known = self.baseline[dtype].failed if dtype in self.baseline else {p: [] for p in POLICIES}
        return Outcome({p: [c for c in names if c not in known[p]] for p, names in failed.items()}, ratios)


def smallest_caught(evaluate: Callable[[float], Outcome]) -> tuple[dict[str, dict[str, Any]], list]:
    """Per policy, the smallest ε caught (`eps`, None when not caught at 1e-1), the largest ε seen not
    caught below it (`below`, None when caught at the grid's first point) and the check that caught
    it; and every point evaluated, (ε, outcome), in order."""
    seen: dict[float, Outcome] = {}

    def at(eps: float) -> Outcome:
        if eps not in seen:
            seen[eps] = evaluate(eps)
        return seen[eps]

    for eps in GRID:
        if all(at(eps).caught(policy) for policy in POLICIES):
            break
    found = {}
    for policy in POLICIES:
        caught = [eps for eps in GRID if eps in seen and seen[eps].caught(policy)]
        if not caught:
            found[policy] = {"eps": None, "below": max(seen), "caught_by": None}
            continue
        hi = caught[0]
        lo = GRID[GRID.index(hi) - 1] if hi != GRID[0] else None
        for _ in range(BISECT_STEPS if lo is not None else 0):
            mid = float(f"{math.sqrt(lo * hi):.2g}")
            if at(mid).caught(policy):
                hi = mid
            else:
                lo = mid
        found[policy] = {"eps": hi, "below": lo, "caught_by": at(hi).caught_by(policy)}
    return found, sorted(seen.items())


def run_dtypes(dumps: DumpSet, requested: str) -> list[str]:
    """`fp32`, `bf16`, or for `all` the dtypes the set has runs of; ValueError for one it lacks."""
    present = [
        d
        for d in fmt.DTYPES
        if any(fmt.result_key(fmt.OUTPUT_KEY, d) in c.keys for c in dumps.cases.values())
    ]
    if requested == "all":
        if not present:
            raise ValueError(f"dump set {dumps.url} has no fp32 or bf16 run")
        return present
    if requested not in present:
        raise ValueError(f"--dtype {requested}: dump set {dumps.url} has no {requested} run")
    return [requested]


def measure_power(
    dumps: DumpSet,
    policy: TolerancePolicy,
    dtypes: list[str],
    chosen: list[Defect],
    selected_cases: list[str] | None,
    kernel: str,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """The power of the suite on `dumps`: the baseline and every defect × dtype, as power.json holds it."""
    meter = PowerMeter(dumps, policy, kernel)
    plans = {
        d.id: {c: checks_for(d, dumps.cases[c].seq_lens) for c in cases_for(d, dumps, selected_cases)}
        for d in chosen
    }
    union: dict[str, list[str]] = {}  # case → every check a defect's plan runs on it, in first-seen order
    for plan in plans.values():
        for case_id, checks in plan.items():
            union[case_id] = list(dict.fromkeys([*union.get(case_id, []), *checks]))
    rows, baselines = [], {}
    for dtype in dtypes:
        started = time.perf_counter()
        progress(f"{dtype}: baseline (no defect) on {sorted(union)}")
        baseline = meter.baseline[dtype] = meter.evaluate(dtype, Injection(), union)
        baselines[dtype] = {
            "cases": sorted(union),
            "failed": baseline.failed,
            "ratios": baseline.ratios,
            "seconds": time.perf_counter() - started,
        }
        rows += [
            _measure_row(meter, defect, dtype, plans[defect.id], progress)
            for defect in chosen
            if dtype in defect.dtypes
        ]
    return {"baseline": baselines, "rows": rows}


def _measure_row(
    meter: PowerMeter,
    defect: Defect,
    dtype: str,
    plan: dict[str, list[str]],
    progress: Callable[[str], None],
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "defect": defect.id,
        "description": defect.description,
        "structural": defect.structural,
        "dtype": dtype,
        "cases": list(plan),
        "goal": None if defect.structural else GOALS[dtype],
    }
    if not plan:
        return {**row, "measured": False, "met": False, "reason": "no case of the run exercises it"}
    progress(f"{dtype}: {defect.id} on {list(plan)}")
    started = time.perf_counter()

    def evaluate(eps: float) -> Outcome:
        return meter.evaluate(dtype, defect.inject(meter.dumps.weights(), eps), plan, defect.layer_class)

    if defect.structural:
        outcome = evaluate(1.0)
        found = {p: {"caught": outcome.caught(p), "caught_by": outcome.caught_by(p)} for p in POLICIES}
        row.update(found, points=[{"failed": outcome.failed}], met=found["default"]["caught"])
    else:
        found, points = smallest_caught(evaluate)
        eps = found["default"]["eps"]
        row.update(found, points=[{"eps": e, "failed": o.failed} for e, o in points])
        row["met"] = eps is not None and eps <= row["goal"]
    return {**row, "measured": True, "seconds": time.perf_counter() - started}
