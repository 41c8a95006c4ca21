"""The serving checks: each scenario run on the implementation's own pool, judged request by request.

Per scenario and dtype (ids `<set>-<dtype>-serving-<scenario>[-<kind>]`, `<set>` being `fixed` or the
scenario file's stem):
- `serving-<s>`: every request's outputs over its life against the same implementation running that
  request alone (one `layer_extend` of its tokens from zero states) and against the float64 truth of
  that request alone (`kda_spec.truth`), judged as every layer check is (`CheckRunner.judge`);
- `serving-<s>-state`: every request's final recurrent state, the same way;
- `serving-<s>-conv`: every request's final conv state against its run alone (no float64 truth of
  it: the absolute gate);
- `serving-<s>-checkpoint`, `serving-<s>-checkpoint-conv` (a scenario with checkpoints): the same two
  of the scenario's checkpoints (`Scenario.checkpoints`: the requests that only hold a copy of another's
  states at a boundary), each against the prefix it holds run alone and its float64 truth: a snapshot
  of a long prefill against the final state of that prefix alone. `-state` and `-conv` judge the
  other requests;
- `serving-<s>-untouched`: every slot holding a request outside a batch, before and after that
  forward: equal to the bit;
- `serving-<s>-identical` (a scenario `same_as` another): its outputs and the other's, equal to the bit;
- `serving-<s>-poisoned` (a scenario that poisons slots): the poisoned slots' states (NaN, 1e30, held or
  free) around every call that runs on the pool: the same bits.
A scenario that needs an optional verb of the serving protocol the adapter does not define skips every
check of it with that reason (`unprovided`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from conformance.adapter import LayerResult, unprovided
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.kinds import Check, CheckKind
from conformance.checks.memo import Memo
from conformance.checks.runner import CheckResult, CheckRunner, Sides
from conformance.checks.sequences import offsets
from conformance.checks.serving_run import HiddenStatistics, ScenarioDriver, ServingRun, scenario_inputs
from conformance.checks.serving_scenarios import Scenario
from conformance.dumps.reader import CaseData, CaseInfo
from conformance.judging.comparison import judge
from conformance.judging.limits import Tolerance
from conformance.judging.measurement import measure

# Equal to the bit: half the smallest float32 step, so that any difference is out of it and none is in.
BIT_EXACT = Tolerance(
    atol=float(np.finfo(np.float32).smallest_subnormal) / 2, rtol=0.0, reason="the same values to the bit"
)


class ServingChecks:
    """The serving checks of `scenarios` (named `set_name`), run through `runner`'s adapters and judged
    by its policy."""

    def __init__(self, runner: CheckRunner, scenarios: Sequence[Scenario], set_name: str):
        self.runner, self.set_name = runner, set_name
        self.scenarios = {scenario.name: scenario for scenario in scenarios}
        self._memo = Memo()
        self._cases: dict[str, CaseData] = {}

    def plan(self, dtypes: Sequence[str]) -> list[CheckSpec]:
        """Every serving check, by scenario, then dtype: each serving kind (`kinds.SERVING_KINDS`), the
        `-identical` one only for a scenario `same_as` another, `-poisoned` for one that poisons slots,
        the `-checkpoint` ones for one with checkpoints."""
        return [
            CheckSpec(self.set_name, dtype, Check(kind, scenario.name))
            for scenario in self.scenarios.values()
            for dtype in dtypes
            for kind in kinds.SERVING_KINDS
            if (kind != kinds.SERVING_IDENTICAL or scenario.same_as)
            and (kind != kinds.SERVING_POISONED or scenario.poisons)
            and (
                kind not in (kinds.SERVING_CHECKPOINT, kinds.SERVING_CHECKPOINT_CONV) or scenario.checkpoints
            )
        ]

    def run(self, spec: CheckSpec) -> CheckResult:
        """Compute and decide one serving check (its kind's function, `_RESULTS`); `CheckSkipped` when it
        cannot run, or its scenario needs an adapter call the adapter's class does not provide."""
        scenario = self.scenarios[spec.of.arg]
        reason = unprovided(self.runner.calls.adapter_class, scenario.calls)
        if reason is not None:
            raise CheckSkipped(reason)
        return _RESULTS[spec.kind](self, scenario, spec)

    def requests_alone(
        self, scenario: Scenario, dtype: str, checkpoints: bool | None = None
    ) -> tuple[list[str], list[LayerResult], CaseData]:
        """The scenario's requests that get a token (only its checkpoints with `checkpoints` True, only
        the others with False), each run alone, and the packed case of them all."""
        names = [
            name for name, tokens in scenario.request_tokens.items()
            if tokens and (checkpoints is None or (name in scenario.checkpoints) == checkpoints)
        ]  # fmt: skip
        if not names:
            why = {True: "has no checkpoint", False: "has no request but its checkpoints"}
            raise CheckSkipped(
                f"scenario {scenario.name!r} {why.get(checkpoints, 'gives no request a token')}"
            )
        return names, [self._alone(scenario, name, dtype) for name in names], self._case(scenario, names)

    def bit_exact(self, spec: CheckSpec, actual: np.ndarray, expected: np.ndarray, what: str) -> CheckResult:
        """`actual` against `expected` (`what`, the same shape), every element equal (atol = rtol = 0),
        under the check's gate mode (without a truth the absolute gate decides)."""
        measured = measure(actual, expected, BIT_EXACT, BIT_EXACT)
        mode = self.runner.policy.mode(spec.check, spec.dtype)
        no_truth = f"bit-exact against {what}: no float64 truth applies"
        return CheckResult(Sides(actual, expected, ()), judge(measured, mode, no_truth=no_truth))

    # ------------------------------------------------------------------------------------- results

    def _memoized(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """compute() once (`Memo`); an adapter without a serving path (NotImplementedError) skips."""

        def skipping() -> Any:
            try:
                return compute()
            except NotImplementedError as err:
                raise CheckSkipped(str(err) or "the adapter has no serving path") from None

        return self._memo.get(key, skipping)

    def run_of(self, scenario: Scenario, dtype: str) -> ServingRun:
        """The scenario run on the implementation's pool, once per dtype."""

        def compute() -> ServingRun:
            guarded = self.runner.calls.guarded(dtype)  # built (or its fault raised) first
            inputs = self._inputs(scenario, dtype)
            config = self.runner.dumps.config
            return ScenarioDriver(guarded, scenario, inputs, self._statistics(), config, dtype).run()

        return self._memoized(("run", scenario.name, dtype), compute)

    def _alone(self, scenario: Scenario, name: str, dtype: str) -> LayerResult:
        """The request run alone: one `layer_extend` of its tokens (a copied one's first tokens its
        source's), from zero states; once per request, token count and origin."""

        def compute() -> LayerResult:
            x = self._inputs(scenario, dtype)[name]
            return self.runner.calls.extend(dtype, x, offsets([len(x)]), None)

        tokens, origin = scenario.request_tokens[name], _origin_chain(scenario, name)
        return self._memoized(("alone", name, tokens, origin, dtype), compute)

    def _inputs(self, scenario: Scenario, dtype: str) -> dict[str, np.ndarray]:
        """Each request's hidden states over its life (`scenario_inputs`), once per scenario and dtype."""
        hidden = self.runner.dumps.config.hidden_size
        return self._memoized(
            ("inputs", scenario.name, dtype),
            lambda: scenario_inputs(scenario, self._statistics(), hidden, dtype),
        )

    def _statistics(self) -> HiddenStatistics:
        """The dump's hidden-state statistics: those of its first case."""
        dumps = self.runner.dumps
        return self._memoized(
            ("statistics",), lambda: HiddenStatistics.of(dumps.case(dumps.case_ids()[0]).hidden_states)
        )

    def _case(self, scenario: Scenario, names: list[str]) -> CaseData:
        """The scenario's requests `names` as one packed case of independent sequences from zero states:
        what the float64 truth (and the bf16 contract's model) of each request alone is computed on."""
        case_id = "/".join((self.set_name, scenario.name, *names))
        if case_id not in self._cases:
            lens = tuple(scenario.request_tokens[name] for name in names)
            x = np.concatenate([self._inputs(scenario, "fp32")[name] for name in names])
            info = CaseInfo(case_id, "", "", lens, False, "chunk", ())
            self._cases[case_id] = CaseData(info, {"hidden_states": x, "cu_seqlens": offsets(lens)})
        return self._cases[case_id]


def _origin_chain(scenario: Scenario, name: str) -> tuple[tuple[str, int], ...]:
    """Where request `name`'s first tokens come from: its source and their count, then the source's."""
    origin, chain = scenario.origin, []
    while name in origin:
        name, count = origin[name]
        chain.append((name, count))
    return tuple(chain)


# ------------------------------------------------------------------------------------ results by kind

ResultFunction = Callable[[ServingChecks, Scenario, CheckSpec], CheckResult]
_RESULTS: dict[CheckKind, ResultFunction] = {}


def _result_of(*of: CheckKind) -> Callable[[ResultFunction], ResultFunction]:
    """Register the function that computes and decides the serving checks of the kinds `of`."""

    def register(function: ResultFunction) -> ResultFunction:
        _RESULTS.update(dict.fromkeys(of, function))
        return function

    return register


_FINAL_STATE = (
    lambda run, name: run.recurrent[name][None],
    lambda alone: alone.final_state,
    "the adapter's layer_extend returns no final state to compare with",
)
_FINAL_CONV = (
    lambda run, name: run.conv[name][None],
    lambda alone: alone.intermediates.get("final_conv_state"),
    "the adapter's layer_extend exposes no final_conv_state to compare with",
)
# A kind judged against each request run alone → (what the scenario's run kept of a request, what the
# request's run alone gave: None where the adapter gives none, the skip's message then), and which
# requests (`ServingChecks.requests_alone`'s `checkpoints`).
_AGAINST_ALONE: dict[
    CheckKind, tuple[Callable[[ServingRun, str], np.ndarray], Callable[[LayerResult], Any], str, bool | None]
] = {
    kinds.SERVING: (lambda run, name: run.outputs[name], lambda alone: alone.out, "", None),
    kinds.SERVING_STATE: (*_FINAL_STATE, False),
    kinds.SERVING_CONV: (*_FINAL_CONV, False),
    kinds.SERVING_CHECKPOINT: (*_FINAL_STATE, True),
    kinds.SERVING_CHECKPOINT_CONV: (*_FINAL_CONV, True),
}


@_result_of(*_AGAINST_ALONE)
def _against_alone(checks: ServingChecks, scenario: Scenario, spec: CheckSpec) -> CheckResult:
    served, own, missing, checkpoints = _AGAINST_ALONE[spec.kind]
    run = checks.run_of(scenario, spec.dtype)
    names, alone, case = checks.requests_alone(scenario, spec.dtype, checkpoints)
    expected = [own(result) for result in alone]
    if any(value is None for value in expected):
        raise CheckSkipped(missing)
    actual = np.concatenate([served(run, name) for name in names])
    checks.runner.use_case(case)
    return checks.runner.judge(case, spec, Sides(actual, np.concatenate(expected), spec.kind.axes))


@_result_of(kinds.SERVING_UNTOUCHED)
def _untouched(checks: ServingChecks, scenario: Scenario, spec: CheckSpec) -> CheckResult:
    run = checks.run_of(scenario, spec.dtype)
    before, after = (np.concatenate([np.zeros(0, np.float32), *parts]) for parts in
                     (run.untouched_before, run.untouched_after))  # fmt: skip
    if before.size == 0:
        raise CheckSkipped(f"scenario {scenario.name!r} has no slot outside a batch")
    return checks.bit_exact(spec, after, before, "slots outside the batch")


@_result_of(kinds.SERVING_POISONED)
def _poisoned(checks: ServingChecks, scenario: Scenario, spec: CheckSpec) -> CheckResult:
    run = checks.run_of(scenario, spec.dtype)
    before, after = (np.concatenate([np.zeros(0, np.uint32), *parts]) for parts in
                     (run.poisoned_before, run.poisoned_after))  # fmt: skip
    if before.size == 0:
        raise CheckSkipped(f"scenario {scenario.name!r} runs nothing beside a poisoned slot")
    changed = (before != after).astype(np.float32)  # NaN's bits compare too
    return checks.bit_exact(
        spec, changed, np.zeros_like(changed), "the poisoned slots' bits before each call"
    )


@_result_of(kinds.SERVING_IDENTICAL)
def _identical(checks: ServingChecks, scenario: Scenario, spec: CheckSpec) -> CheckResult:
    run = checks.run_of(scenario, spec.dtype)
    base = checks.run_of(checks.scenarios[scenario.same_as], spec.dtype)
    actual, expected = (np.concatenate(r.forward_outputs) for r in (run, base))
    return checks.bit_exact(spec, actual, expected, f"the outputs of {scenario.same_as!r}")
