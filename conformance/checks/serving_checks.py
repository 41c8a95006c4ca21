"""The serving checks: each scenario run on the implementation's own pool, judged request by request.

Per scenario and dtype (ids `<set>-<dtype>-serving-<scenario>[-<kind>]`, `<set>` being `fixed` or the
scenario file's stem):
- `serving-<s>`: every request's outputs over its life against the same implementation running that
  request alone (one `layer_extend` of its tokens from zero states) and against the float64 truth of
  that request alone (`kda_spec.truth`), judged as every layer check is (`CheckRunner.judge`);
- `serving-<s>-state`: every request's final recurrent state, the same way;
- `serving-<s>-conv`: every request's final conv state against its run alone (no float64 truth of
  it: the absolute gate);
- `serving-<s>-untouched`: every slot holding a request outside a batch, before and after that
  forward: equal to the bit;
- `serving-<s>-identical` (a scenario `same_as` another): its outputs and the other's, equal to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from conformance.adapter import LayerResult
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.memo import Memo
from conformance.checks.runner import CheckResult, CheckRunner, Sides
from conformance.checks.sequences import offsets
from conformance.checks.serving_run import HiddenStatistics, ServingRun, run_scenario, scenario_inputs
from conformance.checks.serving_scenarios import Scenario
from conformance.dumps.reader import CaseData, CaseInfo
from conformance.judging.comparison import judge
from conformance.judging.limits import Tolerance
from conformance.judging.measurement import measure

SERVING_PREFIX = "serving-"
_OUT_AXES = ("token", "channel")
_STATE_AXES = ("seq", "head", "key", "value")
_CONV_AXES = ("seq", "history", "channel")
# Equal to the bit: half the smallest float32 step, so that any difference is out of it and none is in.
BIT_EXACT = Tolerance(
    atol=float(np.finfo(np.float32).smallest_subnormal) / 2, rtol=0.0, reason="the same values to the bit"
)


def is_serving(spec: CheckSpec) -> bool:
    return spec.check.startswith(SERVING_PREFIX)


class ServingChecks:
    """The serving checks of `scenarios` (named `set_name`), run through `runner`'s adapters and judged
    by its policy."""

    def __init__(self, runner: CheckRunner, scenarios: Sequence[Scenario], set_name: str):
        self.runner, self.set_name = runner, set_name
        self.scenarios = {scenario.name: scenario for scenario in scenarios}
        self._checks: dict[str, tuple[Scenario, str]] = {}
        for scenario in scenarios:
            kinds = ["", "-state", "-conv", "-untouched"] + (["-identical"] if scenario.same_as else [])
            for kind in kinds:
                self._checks[f"{SERVING_PREFIX}{scenario.name}{kind}"] = (scenario, kind)
        self._memo = Memo()
        self._cases: dict[str, CaseData] = {}

    def plan(self, dtypes: Sequence[str]) -> list[CheckSpec]:
        """Every serving check, by scenario, then dtype."""
        return [
            CheckSpec(self.set_name, dtype, check)
            for scenario in self.scenarios.values()
            for dtype in dtypes
            for check, (owner, _) in self._checks.items()
            if owner is scenario
        ]

    def run(self, spec: CheckSpec) -> CheckResult:
        """Compute and decide one serving check; `CheckSkipped` when it cannot run."""
        scenario, kind = self._checks[spec.check]
        run = self._run(scenario, spec.dtype)
        if kind == "-untouched":
            before, after = (np.concatenate([np.zeros(0, np.float32), *parts]) for parts in
                             (run.untouched_before, run.untouched_after))  # fmt: skip
            if before.size == 0:
                raise CheckSkipped(f"scenario {scenario.name!r} has no slot outside a batch")
            return _bit_exact(after, before, "slots outside the batch")
        if kind == "-identical":
            base = self._run(self.scenarios[scenario.same_as], spec.dtype)
            actual, expected = (np.concatenate(r.forward_outputs) for r in (run, base))
            return _bit_exact(actual, expected, f"the outputs of {scenario.same_as!r}")
        names = [name for name, tokens in scenario.request_tokens.items() if tokens]
        if not names:
            raise CheckSkipped(f"scenario {scenario.name!r} gives no request a token")
        alone = [self._alone(scenario, name, spec.dtype) for name in names]
        case = self._case(scenario, names)
        if kind == "-conv":
            conv = [result.intermediates.get("final_conv_state") for result in alone]
            if any(value is None for value in conv):
                raise CheckSkipped("the adapter's layer_extend exposes no final_conv_state to compare with")
            sides = Sides(np.stack([run.conv[name] for name in names]), np.concatenate(conv), _CONV_AXES)
            measured = self.runner.measure(case, spec, sides)
            return CheckResult(
                sides, judge(measured, "absolute", no_truth="no float64 truth of the conv state")
            )
        if kind == "-state":
            if any(result.final_state is None for result in alone):
                raise CheckSkipped("the adapter's layer_extend returns no final state to compare with")
            actual = np.stack([run.recurrent[name] for name in names])
            expected = np.concatenate([result.final_state for result in alone])
            axes = _STATE_AXES
        else:
            actual = np.concatenate([run.outputs[name] for name in names])
            expected = np.concatenate([result.out for result in alone])
            axes = _OUT_AXES
        self.runner.use_case(case)
        return self.runner.judge(case, spec, Sides(actual, expected, axes))

    # ------------------------------------------------------------------------------------- results

    def _memoized(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """compute() once (`Memo`); an adapter without a serving path (NotImplementedError) skips."""

        def skipping() -> Any:
            try:
                return compute()
            except NotImplementedError as err:
                raise CheckSkipped(str(err) or "the adapter has no serving path") from None

        return self._memo.get(key, skipping)

    def _run(self, scenario: Scenario, dtype: str) -> ServingRun:
        def compute() -> ServingRun:
            guarded = self.runner.calls.guarded(dtype)  # built (or its fault raised) first
            config = self.runner.dumps.config
            inputs = scenario_inputs(scenario, self._statistics(), config.hidden_size, dtype)
            return run_scenario(guarded, scenario, inputs, self._statistics(), config, dtype)

        return self._memoized(("run", scenario.name, dtype), compute)

    def _alone(self, scenario: Scenario, name: str, dtype: str) -> LayerResult:
        """The request run alone: one `layer_extend` of its tokens, from zero states."""

        def compute() -> LayerResult:
            config = self.runner.dumps.config
            tokens = scenario.request_tokens[name]
            x = self._statistics().draw(f"request {name}", tokens, config.hidden_size, dtype)
            return self.runner.calls.extend(dtype, x, offsets([tokens]), None)

        return self._memoized(("alone", name, scenario.request_tokens[name], dtype), compute)

    def _statistics(self) -> HiddenStatistics:
        """The dump's hidden-state statistics: those of its first case."""
        dumps = self.runner.dumps
        return self._memoized(
            ("statistics",), lambda: HiddenStatistics.of(dumps.case(dumps.case_ids()[0]).hidden_states)
        )

    def _case(self, scenario: Scenario, names: list[str]) -> CaseData:
        """The scenario's requests as one packed case of independent sequences from zero states: what
        the float64 truth (and the bf16 contract's model) of each request alone is computed on."""
        if scenario.name not in self._cases:
            hidden = self.runner.dumps.config.hidden_size
            lens = tuple(scenario.request_tokens[name] for name in names)
            x = np.concatenate([self._statistics().draw(f"request {n}", t, hidden, "fp32")
                                for n, t in zip(names, lens)])  # fmt: skip
            info = CaseInfo(f"{self.set_name}/{scenario.name}", "", "", lens, False, "chunk", ())
            self._cases[scenario.name] = CaseData(info, {"hidden_states": x, "cu_seqlens": offsets(lens)})
        return self._cases[scenario.name]


def _bit_exact(
    actual: np.ndarray,  # [n] or [T, hidden]
    expected: np.ndarray,  # the same shape
    what: str,
) -> CheckResult:
    """`actual` against `expected`, every element equal (atol = rtol = 0)."""
    measured = measure(actual, expected, BIT_EXACT, BIT_EXACT)
    no_truth = f"bit-exact against {what}: no float64 truth applies"
    return CheckResult(Sides(actual, expected, ()), judge(measured, "absolute", no_truth=no_truth))
