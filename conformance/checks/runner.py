"""`CheckRunner`: each check's result (`ImplementationCalls`) paired with its reference, measured,
judged against its float64 truth and the bf16 precision contract's model, and decided by the check's
gate mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from conformance.adapter import KDAAdapter
from conformance.adapters.guard import CallWatchdog
from conformance.checks.calls import ImplementationCalls, l2norm
from conformance.checks.catalogue import KERNEL_CHECKS, CheckSkipped, CheckSpec, decode_run, truth_name
from conformance.checks.reductions import reduction_of
from conformance.checks.truth import (
    COMPUTED_LAYER_TRUTH_SOURCE,
    CONTRACT_SOURCE,
    FP32_STAGES,
    KERNEL_INPUTS,
    NoTruth,
    computed_contract_model,
    computed_layer_truth,
    computed_matmul_model,
    layer_kernel_truth,
    not_computed,
    recurrence_fp64,
    stored_truth,
)
from conformance.dumps.reader import CaseData, DumpSet
from conformance.judging.attribution import Attribution, attribute
from conformance.judging.comparison import Comparison, judge
from conformance.judging.contract import ContractCheck, contract_check
from conformance.judging.matmul_diagnosis import MATMUL_MODELS, MatmulDiagnosis, diagnose
from conformance.judging.measurement import StatisticRows, measure
from conformance.judging.positions import (
    DECODE_POSITIONS,
    POSITION_CHECKS,
    PositionProfile,
    judge_by_windows,
    position_profile,
)
from conformance.judging.reduction import reduction_limits
from conformance.judging.tolerances import CONTRACT_MODE, RelativeLimits, TolerancePolicy
from kda_spec import dump_format as fmt

_OUT_AXES = ("token", "channel")
_HEAD_AXES = ("token", "head", "channel")
_STATE_AXES = ("seq", "head", "key", "value")
KERNEL_TRUTH_SOURCE = "float64 recurrence on the dumped kernel inputs"


# What the runner memoizes per case that depends on the dump alone, never on the implementation: the
# truths and the models (`forget_implementation_results` keeps them).
CASE_DERIVED = frozenset({"layer-truth", "kernel-truth", "contract-model", "matmul-model"})


class CheckRunner(ImplementationCalls):
    """Computes and decides checks under `policy`; the long cases' windows are kept in
    `position_profiles`, by check id."""

    def __init__(
        self,
        dumps: DumpSet,
        adapter_class: type[KDAAdapter],
        kernel: str,
        policy: TolerancePolicy,
        options: Mapping[str, str] | None = None,
        watchdog: CallWatchdog | None = None,
    ):
        super().__init__(dumps, adapter_class, kernel, options, watchdog)
        self.policy = policy
        self.position_profiles: dict[str, PositionProfile] = {}

    def forget_implementation_results(self) -> None:
        """Forget the implementation's results of the current case (its adapter changed), keeping what the
        case's dump alone gives (`CASE_DERIVED`)."""
        self._memo = {key: value for key, value in self._memo.items() if key[0] in CASE_DERIVED}

    # --------------------------------------------------------------------------------------- checks

    def run(self, spec: CheckSpec) -> Comparison:
        """Compute and compare one check; `CheckSkipped` when it cannot run."""
        case = self.case(spec.case_id)
        if not case.has_dtype(spec.dtype):
            raise CheckSkipped(f"the dump has no {spec.dtype} run (no {fmt.result_key('out', spec.dtype)})")
        if spec.check in POSITION_CHECKS:
            return self.by_position(case, spec)
        actual, expected, axes, positions = self.pair(case, spec)
        return self.compare(case, spec, np.asarray(actual), expected, axes, positions)

    def compare(
        self,
        case: CaseData,
        spec: CheckSpec,
        actual: np.ndarray,
        expected: np.ndarray,
        axes: tuple[str, ...],
        positions: dict,
        truth: Callable[[], tuple[np.ndarray, str]] | None = None,
    ) -> Comparison:
        """`actual` against `expected` under the check's tolerance, both against the check's float64
        truth where there is one, decided by the check's gate mode. `truth` gives (truth, source) in
        place of the check's own (or raises `NoTruth`)."""
        tolerance = self.policy.tolerance(spec.check, spec.dtype)
        rfc, min_tokens = self.policy.rfc[spec.dtype], self.policy.min_tokens
        measured = measure(actual, expected, tolerance, rfc, axes, positions, case.info.seq_lens, min_tokens)
        mode = self.policy.mode(spec.check, spec.dtype)
        if not measured.usable:
            return judge(measured, mode, None, "nothing compared")
        try:
            truth_value, source = truth() if truth else self.truth(case, spec, positions)
        except NoTruth as missing:
            return judge(measured, mode, None, str(missing))
        limits = self.relative_limits(spec.check, spec.dtype, truth_value, axes)
        attribution = attribute(actual, expected, truth_value, source, tolerance, limits, measured.apart)
        if mode != CONTRACT_MODE:
            judged = judge(measured, mode, attribution)
            if judged.passed or attribution.verdict != "impl" or spec.dtype != "fp32":
                return judged
            diagnosis = self.matmul_diagnosis(case, spec, actual, truth_value, positions)
            return dataclasses.replace(judged, matmul_diagnosis=diagnosis)
        try:
            contract = self.contract(
                case, spec, actual, expected, truth_value, attribution, positions, measured.gating
            )
        except NoTruth as missing:
            return judge(measured, mode, attribution, no_contract=str(missing))
        return judge(measured, mode, attribution, contract=contract)

    def relative_limits(
        self, check: str, dtype: str, truth: np.ndarray, axes: tuple[str, ...]
    ) -> RelativeLimits:
        """The relative gate's limits of `check` in the `dtype` run, its floors raised to the rounding
        budget of its widest fp32 reduction on this `truth` (whose axes are `axes`)."""
        head_axis = axes.index("head") if "head" in axes else None
        return reduction_limits(
            self.policy.relative[dtype],
            reduction_of(check, self.dumps.config),
            truth,
            self.policy.tolerance(check, dtype),
            head_axis,
        )

    def matmul_diagnosis(
        self, case: CaseData, spec: CheckSpec, actual: np.ndarray, truth: np.ndarray, positions: dict
    ) -> MatmulDiagnosis | None:
        """Which reduced-precision matmul a failing fp32 layer result matches, if any
        (`conformance.judging.matmul_diagnosis`); None for a kernel check (its inputs are the dump's)."""
        if spec.check in KERNEL_CHECKS:
            return None
        name = truth_name(spec.check)
        models = {}
        for model in MATMUL_MODELS:
            try:
                results = self._memoized(
                    ("matmul-model", model.name),
                    lambda bits=model.mantissa_bits: computed_matmul_model(
                        case, self.weights(), self.dumps.config, bits
                    ),
                )
            except NoTruth:
                return None
            if name in results:
                models[model.name] = (
                    results[name][positions["token"]] if "token" in positions else results[name]
                )
        return diagnose(actual, truth, models)

    def contract(
        self,
        case: CaseData,
        spec: CheckSpec,
        actual: np.ndarray,
        expected: np.ndarray,
        truth: np.ndarray,
        attribution: Attribution,
        positions: dict,
        gating: StatisticRows,
    ) -> ContractCheck:
        """The check's two sides against the bf16 precision contract's float64 model of its result (and
        the model against the check's `truth`, whose `attribution` holds the implementation's error),
        under the minimum-tokens rule's `gating` of the result; `NoTruth` when there is none (a kernel
        check, a result the model lacks)."""
        model = self.contract_model(case, spec, positions)
        limits, fp32_stage = self.policy.contract, truth_name(spec.check) in FP32_STAGES
        impl_error = attribution.impl.nrmse
        check = contract_check(
            actual, expected, model, truth, impl_error, CONTRACT_SOURCE, limits, fp32_stage, gating
        )
        if check.fixed_limits_hold:
            return check
        return check.with_spread(self.contract_model(case, spec, positions, spread=True), model)

    def contract_model(
        self, case: CaseData, spec: CheckSpec, positions: dict, spread: bool = False
    ) -> np.ndarray:
        """The bf16 precision contract's float64 model of the check's result (its rows at `positions`), or
        with `spread` the model with its rounded values moved by one fp32 ulp first
        (`computed_contract_model`); `NoTruth` when there is none (a kernel check, a result the model of a
        long case lacks)."""
        if spec.check in KERNEL_CHECKS:
            raise NoTruth("the precision contract has no rounding point inside the kernels")
        name = truth_name(spec.check)
        models = self._memoized(
            ("contract-model", spec.dtype, spread),
            lambda: computed_contract_model(case, self.weights(), self.dumps.config, spread),
        )
        if name not in models:
            raise not_computed(case, name, "the precision contract's model")
        return models[name][positions["token"]] if "token" in positions else models[name]

    def by_position(self, case: CaseData, spec: CheckSpec) -> Comparison:
        """A long case's output (its prefill, or its prefill then decode steps) against the reference and
        the float64 truth window by window, gated by the relative gate in every window."""
        dtype, decode_steps = spec.dtype, case.info.decode_steps
        if spec.check == DECODE_POSITIONS:
            actual, _ = self.decode_full(case, dtype, decode_steps)
        else:
            actual = np.asarray(self.layer(case, dtype).out)
        expected = self._expected(case, "out", dtype)
        try:
            truth, source = self.layer_truth(case, "out", dtype)
        except NoTruth as missing:
            raise CheckSkipped(f"{missing}: the error by position is measured against it") from None
        tolerance = self.policy.tolerance(spec.check, dtype)
        rfc, min_tokens = self.policy.rfc[dtype], self.policy.min_tokens
        measured = measure(actual, expected, tolerance, rfc, _OUT_AXES, {}, case.info.seq_lens, min_tokens)
        if not measured.usable:
            return judge(measured, self.policy.mode(spec.check, dtype), None, "nothing compared")
        profile = position_profile(
            actual,
            expected,
            truth,
            tolerance,
            self.relative_limits(spec.check, dtype, truth, _OUT_AXES),
            case_id=case.info.case_id,
            dtype=dtype,
            check=spec.check,
            decode_from=case.info.total_tokens - decode_steps if spec.check == DECODE_POSITIONS else None,
        )
        self.position_profiles[spec.id] = profile
        return judge_by_windows(measured, profile, source)

    def truth(self, case: CaseData, spec: CheckSpec, positions: dict) -> tuple[np.ndarray, str]:
        """The check's float64 truth and where it comes from; `NoTruth` when there is none."""
        if spec.check in KERNEL_CHECKS:
            o, state = self.kernel_truth(case, spec.dtype)
            value, source = (o if KERNEL_CHECKS[spec.check][1] == "o" else state), KERNEL_TRUTH_SOURCE
        else:
            value, source = self.layer_truth(case, truth_name(spec.check), spec.dtype)
            if "token" in positions:
                value = value[positions["token"]]
        if not np.all(np.isfinite(value)):
            raise NoTruth(f"the truth ({source}) holds NaN/Inf values")
        return value, source

    def layer_truth(self, case: CaseData, name: str, dtype: str) -> tuple[np.ndarray, str]:
        """The float64 truth of layer result `name` and its source: the dump's stored one, else the one
        computed here from the dump's inputs and weights, whatever wrote the set
        (`conformance.checks.truth.computed_layer_truth`); `NoTruth` where that computation has no `name`."""
        try:
            return stored_truth(case, name, dtype), f"dump: {fmt.truth_key(name, dtype)}"
        except NoTruth:
            pass

        def compute() -> dict[str, np.ndarray]:
            return computed_layer_truth(case, dtype, self.weights(), self.dumps.config)

        computed = self._memoized(("layer-truth", dtype), compute)
        if name not in computed:
            raise not_computed(case, name, "the truth computed here")
        return computed[name], COMPUTED_LAYER_TRUTH_SOURCE

    def layer_kernel_truth(self, case: CaseData, dtype: str) -> tuple[np.ndarray, str]:
        """The truth of the kernel output inside the layer (`o_kda`) and its source: the float64
        recurrence on the truths (`layer_truth`) of the layer's q, k, v, g, beta."""
        inputs = (self.layer_truth(case, name, dtype)[0] for name in KERNEL_INPUTS)
        o = layer_kernel_truth(*inputs, case.cu_seqlens, case.initial_state)
        return o, "float64 recurrence on the truth's q, k, v, g, beta"

    def kernel_truth(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """The float64 recurrence on the dumped kernel inputs of the `dtype` run (q, k l2-normalised in
        fp32 as the kernels get them): the truth of both kernel paths, (o, final states)."""

        def compute() -> tuple[np.ndarray, np.ndarray]:
            q, k, v, g, beta = (self._expected(case, name, dtype) for name in KERNEL_INPUTS)
            return recurrence_fp64(l2norm(q), l2norm(k), v, g, beta, case.cu_seqlens, case.initial_state)

        return self._memoized(("kernel-truth", dtype), compute)

    def pair(self, case: CaseData, spec: CheckSpec) -> tuple[Any, np.ndarray, tuple[str, ...], dict]:
        """(result, reference, axis names, positions) of one check."""
        check, dtype = spec.check, spec.dtype
        if check == "layer":
            return self.layer(case, dtype).out, self._expected(case, "out", dtype), _OUT_AXES, {}
        if check == "layer-state":
            state = self.layer(case, dtype).final_state
            if state is None:
                raise CheckSkipped(f"adapter {self.adapter(dtype).name!r} returns no final recurrent state")
            reference = self._expected(case, f"recurrent_state_{case.info.layer_kernel_path}", dtype)
            return state, reference, _STATE_AXES, {}
        if check in KERNEL_CHECKS:
            path, which = KERNEL_CHECKS[check]
            o, state = self.kernel_on_dump(case, dtype, path)
            if which == "o":
                return o, self._expected(case, f"o_kda_{path}", dtype), _HEAD_AXES, {}
            return state, self._expected(case, f"recurrent_state_{path}", dtype), _STATE_AXES, {}
        if check in fmt.INTERMEDIATE_KEYS:
            reference = self._expected(case, check, dtype)
            value = self.layer(case, dtype).intermediates.get(check)
            if value is None:
                raise CheckSkipped(f"adapter {self.adapter(dtype).name!r} does not expose {check!r}")
            return value, reference, _HEAD_AXES[: reference.ndim], {}
        if check.startswith("decode-"):
            decoded, token_rows = self.decode(case, dtype, decode_run(check))
            if check.endswith("-self"):
                reference = np.asarray(self.layer(case, dtype).out)[token_rows]
            else:
                reference = self._expected(case, "out", dtype)[token_rows]
            return decoded, reference, _OUT_AXES, {"token": token_rows}
        if check.startswith("chunked-prefill"):
            out, state = self.chunked_prefill(case, dtype)
            if check == "chunked-prefill":
                return out, self._expected(case, "out", dtype), _OUT_AXES, {}
            if state is None:
                raise CheckSkipped(f"adapter {self.adapter(dtype).name!r} returns no final recurrent state")
            reference = self._expected(case, f"recurrent_state_{case.info.layer_kernel_path}", dtype)
            return state, reference, _STATE_AXES, {}
        raise ValueError(f"unknown check {check!r}")

    @staticmethod
    def _expected(case: CaseData, name: str, dtype: str) -> np.ndarray:
        value = case.result(name, dtype)
        if value is None:
            raise CheckSkipped(f"the dump has no {fmt.result_key(name, dtype)!r}")
        return value
