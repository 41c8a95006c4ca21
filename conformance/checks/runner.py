"""`CheckRunner`: each check's two sides (the implementation's result from `ImplementationCalls`, the
dump's reference) measured, judged against the float64 truth and the bf16 precision contract's model,
and decided by the check's gate mode: one `CheckResult` per check."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping

import numpy as np

from conformance.adapter import KDAAdapter
from conformance.adapters.guard import CallWatchdog
from conformance.checks import kinds
from conformance.checks.calls import (
    ImplementationCalls,
    gate_parameters,
    kernel_arguments,
    l2norm,
    raw_gate_kernel_inputs,
)
from conformance.checks.catalogue import CheckSkipped, CheckSpec
from conformance.checks.causality import (
    changed_bits,
    changed_from,
    cotangents_before,
    gradient_breaks,
    hidden_states_changed_from,
    layer_gradient_breaks,
    split_positions,
)
from conformance.checks.kinds import CheckKind
from conformance.checks.memo import Memo
from conformance.checks.reductions import reduction_of
from conformance.checks.truth import (
    COMPUTED_LAYER_TRUTH_SOURCE,
    CONTRACT_SOURCE,
    FP32_STAGES,
    KERNEL_INPUTS,
    SPREAD_DRAWS,
    NoTruth,
    computed_contract_model,
    computed_layer_truth,
    computed_matmul_model,
    computed_reduction_spread,
    gradient_cotangents,
    layer_cotangents,
    not_computed,
    recurrence_fp64,
    stored_truth,
)
from conformance.dumps.reader import CaseData, DumpSet
from conformance.judging.attribution import attribute, error_vs_truth
from conformance.judging.comparison import Comparison, judge
from conformance.judging.contract import ContractCheck, contract_check
from conformance.judging.limits import RelativeLimits, Tolerance
from conformance.judging.matmul_diagnosis import MATMUL_MODELS, MatmulDiagnosis, diagnose
from conformance.judging.measurement import Measurement, measure
from conformance.judging.positions import PositionProfile, judge_by_windows, position_profile
from conformance.judging.reduction import FP32_UNIT_ROUNDOFF, ReductionSpread, reduction_limits, spread_of
from conformance.judging.verdict import CONTRACT_MODE
from conformance.policy import TolerancePolicy
from kda_spec import dump_format as fmt
from kda_spec.gradients import layer_gradient_results
from kda_spec.layer_vjp import layer_vjp
from kda_spec.truth import (
    l2_normalised,
    packed_chunk_start_states,
    packed_delta_rule,
    packed_delta_rule_vjp,
    raw_gate_decay,
    run_hidden_states,
    run_weights,
)

KERNEL_TRUTH_SOURCE = "float64 recurrence on the dumped kernel inputs"
RAW_GATE_KERNEL_TRUTH_SOURCE = (
    "float64 recurrence on the dumped kernel inputs, g the float64 gate of the dumped g_raw, A_log, dt_bias"
)
OWN_INPUTS_TRUTH_SOURCE = "float64 recurrence on the layer's own q, k, v, g, beta (its intermediates)"
GRADIENT_TRUTH_SOURCE = (
    "float64 recurrence's vector-Jacobian product (kda_spec.truth.packed_delta_rule_vjp) on the dumped "
    "kernel inputs, for the case's cotangents (the dump's, else seeded by the case)"
)
LAYER_GRADIENT_TRUTH_SOURCE = (
    "float64 layer's vector-Jacobian product (kda_spec.layer_vjp) on the dump's inputs and weights, for "
    "the case's cotangents (the dump's, else seeded by the case)"
)
# The unit roundoff of each run's arithmetic: a layer weight gradient's spread is in its units.
UNIT_ROUNDOFF = {"fp32": FP32_UNIT_ROUNDOFF, "bf16": 2.0**-8}
CHECKPOINT_KERNEL_TRUTH_SOURCE = (
    f"float64 recurrence on the dumped kernel inputs, its state entering every {kinds.CHECKPOINT_CHUNK_SIZE}-"
    "token chunk"
)


@dataclasses.dataclass(frozen=True)
class Sides:
    """A check's two sides: the implementation's result and the reference (one shape), the names of
    their axes, and for a selection of rows each row's position in the case (`positions`: axis →
    indices)."""

    actual: np.ndarray
    expected: np.ndarray
    axes: tuple[str, ...]
    positions: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actual", np.asarray(self.actual))

    def rows_of(self, whole: np.ndarray) -> np.ndarray:
        """`whole` (a result of the whole case) at this check's rows."""
        return whole[self.positions["token"]] if "token" in self.positions else whole


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check: its sides, its decided `comparison`, and the float64 `truth` and the precision
    contract's `model` it was judged against (None where it had none)."""

    sides: Sides
    comparison: Comparison
    truth: np.ndarray | None = None
    model: np.ndarray | None = None


class CheckRunner:
    """Computes and decides checks under `policy`, calling the implementation through `calls`; the long
    cases' windows are kept in `position_profiles`, by check id."""

    def __init__(
        self,
        dumps: DumpSet,
        adapter_class: type[KDAAdapter],
        kernel: str,
        policy: TolerancePolicy,
        options: Mapping[str, str] | None = None,
        watchdog: CallWatchdog | None = None,
    ):
        self.dumps = dumps
        self.calls = ImplementationCalls(dumps, adapter_class, kernel, options, watchdog)
        self.policy = policy
        self.position_profiles: dict[str, PositionProfile] = {}
        self._derived = Memo()  # what the current case's dump alone gives: truths, models
        self._derived_case: CaseData | None = None

    def case(self, case_id: str) -> CaseData:
        return self._on(self.calls.case(case_id))

    def use_case(self, case: CaseData) -> None:
        """Judge the next checks on `case`, one the dump does not hold (`ImplementationCalls.use_case`)."""
        self.calls.use_case(case)
        self._on(case)

    def _on(self, case: CaseData) -> CaseData:
        if case is not self._derived_case:
            self._derived.clear()
            self._derived_case = case
        return case

    # --------------------------------------------------------------------------------------- checks

    def run(self, spec: CheckSpec) -> CheckResult:
        """Compute and decide one check; `CheckSkipped` when it cannot run."""
        case = self.case(spec.case_id)
        if not case.has_dtype(spec.dtype):
            raise CheckSkipped(f"the dump has no {spec.dtype} run (no {fmt.result_key('out', spec.dtype)})")
        if spec.kind in kinds.BY_POSITION_KINDS:
            return self.by_position(case, spec)
        return self.judge(case, spec, self.sides(case, spec))

    def measure(self, case: CaseData, spec: CheckSpec, sides: Sides) -> Measurement:
        """`sides` measured under the check's tolerance and the policy's minimum-tokens rule."""
        policy = self.policy
        return measure(
            sides.actual, sides.expected, policy.tolerance(spec.check, spec.dtype), policy.rfc[spec.dtype],
            sides.axes, dict(sides.positions), case.info.seq_lens, policy.min_tokens,
        )  # fmt: skip

    def judge(
        self,
        case: CaseData,
        spec: CheckSpec,
        sides: Sides,
        truth: Callable[[], tuple[np.ndarray, str]] | None = None,
    ) -> CheckResult:
        """`sides` measured under the check's tolerance, both against the check's float64 truth where
        there is one, decided by the check's gate mode. `truth` gives (truth, source) in place of the
        check's own (or raises `NoTruth`)."""
        measured = self.measure(case, spec, sides)
        unusable = self.unusable(spec, sides, measured)
        if unusable is not None:
            return unusable
        mode = self.policy.mode(spec.check, spec.dtype)
        try:
            truth_value, source = truth() if truth else self.truth(case, spec, sides)
        except NoTruth as missing:
            no_contract = str(missing) if mode == CONTRACT_MODE else None  # the model is judged by the truth
            return CheckResult(sides, judge(measured, mode, no_truth=str(missing), no_contract=no_contract))
        limits = self.relative_limits(case, spec, measured.tolerance, truth_value, sides)
        attribution = attribute(
            sides.actual, sides.expected, truth_value, source, measured.tolerance, limits,
            measured.out_of_tolerance,
        )  # fmt: skip
        if mode != CONTRACT_MODE:
            judged = judge(measured, mode, attribution)
            if not (judged.passed or attribution.blame != "impl" or spec.dtype != "fp32"):
                diagnosis = self.matmul_diagnosis(case, spec, sides, truth_value)
                judged = dataclasses.replace(judged, matmul_diagnosis=diagnosis)
            return CheckResult(sides, judged, truth_value)
        try:
            contract, model = self.contract(case, spec, sides, truth_value, attribution.impl.nrmse, measured)
        except NoTruth as missing:
            return CheckResult(
                sides, judge(measured, mode, attribution, no_contract=str(missing)), truth_value
            )
        return CheckResult(sides, judge(measured, mode, attribution, contract=contract), truth_value, model)

    def relative_limits(
        self,
        case: CaseData,
        spec: CheckSpec,
        tolerance: Tolerance,
        truth: np.ndarray,
        sides: Sides,
        with_spread: bool = True,
    ) -> RelativeLimits:
        """The relative gate's limits of `spec` (held to `tolerance`), its floors raised to the rounding
        budget of its widest fp32 reduction on this `truth` (the check's rows, as `sides`), and, where
        `with_spread`, the reductions' spread of a layer result (`reduction_spread`)."""
        axes = sides.axes
        head_axis = axes.index("head") if "head" in axes else None
        limits = reduction_limits(
            self.policy.relative[spec.dtype],
            reduction_of(spec.kind, self.dumps.config, case.info.total_tokens, spec.of.arg), truth, tolerance,
            head_axis,
        )  # fmt: skip
        spread = self.reduction_spread(case, spec, tolerance, truth, sides) if with_spread else None
        return limits if spread is None else dataclasses.replace(limits, spread=spread)

    def reduction_spread(
        self, case: CaseData, spec: CheckSpec, tolerance: Tolerance, truth: np.ndarray, sides: Sides
    ) -> ReductionSpread | None:
        """The reductions' spread of the check's result at its rows (`computed_reduction_spread`: each
        draw's move, measured against `truth` under `tolerance`); None where the policy sets no
        `spread_lambda` for the dtype, for a kernel check (judged on the dump's kernel inputs), and where
        the spread is not computed (a case over `COMPUTE_MAX_TOKENS` tokens, a result its layer lacks); a
        layer weight gradient's is `gradient_spread`."""
        if spec.kind == kinds.LAYER_GRAD_WEIGHT:
            return self.gradient_spread(case, spec, tolerance, truth)
        spread_lambda = self.policy.relative[spec.dtype].spread_lambda
        if not spread_lambda or spec.kind.truth != kinds.LAYER_TRUTH:
            return None
        try:
            draws = self._derived.get(
                ("reduction-spread", spec.dtype),
                lambda: computed_reduction_spread(
                    case, spec.dtype, self.dumps.weights(), self.dumps.config, spread_lambda
                ),
            )
        except NoTruth:
            return None
        name = spec.of.result
        if name not in draws[0]:
            return None
        moves = [np.asarray(sides.rows_of(draw[name]), np.float64) for draw in draws]
        errors = [error_vs_truth(truth + move, truth, tolerance) for move in moves]
        return spread_of(
            [e.margin for e in errors], [e.nrmse for e in errors], moves, self.policy.relative[spec.dtype]
        )

    def unusable(self, spec: CheckSpec, sides: Sides, measured: Measurement) -> CheckResult | None:
        """The decided check of a measurement that compared nothing (`Measurement.unusable`), else None."""
        if measured.usable:
            return None
        return CheckResult(sides, judge(measured, self.policy.mode(spec.check, spec.dtype)))

    def matmul_diagnosis(
        self, case: CaseData, spec: CheckSpec, sides: Sides, truth: np.ndarray
    ) -> MatmulDiagnosis | None:
        """Which reduced-precision matmul a failing fp32 layer result matches, if any
        (`conformance.judging.matmul_diagnosis`); None for a check judged on the dump's kernel inputs."""
        if spec.kind.truth != kinds.LAYER_TRUTH:
            return None
        name = spec.of.result
        models = {}
        for model in MATMUL_MODELS:
            try:
                results = self._derived.get(
                    ("matmul-model", model.name),
                    lambda bits=model.mantissa_bits: computed_matmul_model(
                        case, self.dumps.weights(), self.dumps.config, bits
                    ),
                )
            except NoTruth:
                return None
            if name in results:
                models[model.name] = sides.rows_of(results[name])
        return diagnose(sides.actual, truth, models)

    def contract(
        self,
        case: CaseData,
        spec: CheckSpec,
        sides: Sides,
        truth: np.ndarray,
        impl_truth_nrmse: float,
        measured: Measurement,
    ) -> tuple[ContractCheck, np.ndarray]:
        """The check's two sides against the bf16 precision contract's float64 model of its result (and
        the model against the check's `truth`, beside the implementation's nRMSE against it), under the
        minimum-tokens rule of `measured`; with the model. `NoTruth` when there is none (a kernel check,
        a result the model lacks)."""
        model = self.contract_model(case, spec, sides)
        limits, fp32_stage = self.policy.contract, spec.of.result in FP32_STAGES
        check = contract_check(
            sides.actual, sides.expected, model, truth, impl_truth_nrmse, CONTRACT_SOURCE, limits, fp32_stage,
            measured.gating,
        )  # fmt: skip
        if not check.fixed_limits_hold:
            check = check.with_spread(self.contract_model(case, spec, sides, spread=True), model)
        return check, model

    def contract_model(
        self, case: CaseData, spec: CheckSpec, sides: Sides, spread: bool = False
    ) -> np.ndarray:
        """The bf16 precision contract's float64 model of the check's result (at its rows), or with
        `spread` the model with its rounded values moved by one fp32 ulp first (`computed_contract_model`);
        `NoTruth` when there is none (a kernel check, a result the model of a long case lacks)."""
        if not spec.kind.contract:
            raise NoTruth("the precision contract has no rounding point inside the kernels")
        name = spec.of.result
        models = self._derived.get(
            ("contract-model", spec.dtype, spread),
            lambda: computed_contract_model(case, self.dumps.weights(), self.dumps.config, spread),
        )
        if name not in models:
            raise not_computed(case, name, "the precision contract's model")
        return sides.rows_of(models[name])

    def by_position(self, case: CaseData, spec: CheckSpec) -> CheckResult:
        """A long case's output (its prefill, or its prefill then decode steps) against the reference and
        the float64 truth window by window, gated by the relative gate in every window."""
        dtype, decode_steps = spec.dtype, case.info.decode_steps
        decodes = spec.kind == kinds.BY_POSITION_DECODE
        if decodes:
            actual, _ = self.calls.decode_full(case, dtype, decode_steps)
        else:
            actual = np.asarray(self.calls.layer(case, dtype).out)
        sides = Sides(actual, self.expected(case, "out", dtype), spec.kind.axes)
        try:
            truth, source = self.layer_truth(case, "out", dtype)
        except NoTruth as missing:
            raise CheckSkipped(f"{missing}: the error by position is measured against it") from None
        measured = self.measure(case, spec, sides)
        unusable = self.unusable(spec, sides, measured)
        if unusable is not None:
            return unusable
        profile = position_profile(
            sides.actual,
            sides.expected,
            truth,
            measured.tolerance,
            # the windows' limits without the spread: it is a whole-result statistic
            self.relative_limits(case, spec, measured.tolerance, truth, sides, with_spread=False),
            case_id=case.info.case_id,
            dtype=dtype,
            check=spec.check,
            decode_from=case.info.total_tokens - decode_steps if decodes else None,
        )
        self.position_profiles[spec.id] = profile
        return CheckResult(sides, judge_by_windows(measured, profile, source), truth)

    def truth(self, case: CaseData, spec: CheckSpec, sides: Sides) -> tuple[np.ndarray, str]:
        """The check's float64 truth (at its rows) and where it comes from; `NoTruth` when there is none."""
        kind = spec.kind
        if kind.truth is None:
            raise NoTruth(kind.no_truth)
        if kind.truth == kinds.CHECKPOINT_KERNEL_TRUTH:
            value = self.checkpoint_states(case, spec.dtype, np.float64)
            source = CHECKPOINT_KERNEL_TRUTH_SOURCE
        elif kind.truth == kinds.OWN_INPUTS_TRUTH:
            value, source = self.own_inputs_state(case, spec.dtype, np.float64), OWN_INPUTS_TRUTH_SOURCE
        elif kind.truth == kinds.GRADIENT_TRUTH:
            value = self.kernel_gradients(case, spec.dtype, np.float64)[spec.of.result]
            source = GRADIENT_TRUTH_SOURCE
        elif kind.truth == kinds.LAYER_GRADIENT_TRUTH:
            value = self.layer_gradients(case, spec.dtype, np.float64)[spec.of.result]
            source = LAYER_GRADIENT_TRUTH_SOURCE
        elif kind.truth in (kinds.KERNEL_TRUTH, kinds.RAW_GATE_KERNEL_TRUTH):
            raw_gate = kind.truth == kinds.RAW_GATE_KERNEL_TRUTH
            o, state = self.kernel_truth(case, spec.dtype, raw_gate)
            value = o if kind.result == "o" else state
            source = RAW_GATE_KERNEL_TRUTH_SOURCE if raw_gate else KERNEL_TRUTH_SOURCE
        else:
            value, source = self.layer_truth(case, spec.of.result, spec.dtype)
            value = sides.rows_of(value)
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
            return computed_layer_truth(case, dtype, self.dumps.weights(), self.dumps.config)

        computed = self._derived.get(("layer-truth", dtype), compute)
        if name not in computed:
            raise not_computed(case, name, "the truth computed here")
        return computed[name], COMPUTED_LAYER_TRUTH_SOURCE

    def layer_kernel_truth(self, case: CaseData, dtype: str) -> tuple[np.ndarray, str]:
        """The truth of the kernel output inside the layer (`o_kda`) and its source: the float64
        recurrence on the truths (`layer_truth`) of the layer's q, k, v, g, beta."""
        q, k, v, g, beta = (self.layer_truth(case, name, dtype)[0] for name in KERNEL_INPUTS)
        inputs = (l2_normalised(q), l2_normalised(k), v, g, beta)
        o, _ = recurrence_fp64(inputs, case.cu_seqlens, case.initial_state)
        return o, "float64 recurrence on the truth's q, k, v, g, beta"

    def kernel_truth(
        self, case: CaseData, dtype: str, raw_gate: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The float64 recurrence on the dumped kernel inputs of the `dtype` run (q, k l2-normalised in
        fp32 as the kernels get them): the truth of both kernel paths, (o, final states). With
        `raw_gate`, the truth of their raw-gate form: its log decay the float64 gate of the dumped raw
        gate, `A_log` and `dt_bias` (`kda_spec.truth.raw_gate_decay`), not the dumped `g`."""

        def compute() -> tuple[np.ndarray, np.ndarray]:
            names = raw_gate_kernel_inputs() if raw_gate else KERNEL_INPUTS
            q, k, v, g, beta = (self.expected(case, name, dtype) for name in names)
            if raw_gate:  # `g` is the raw gate
                config = self.dumps.config
                a_log, dt_bias = (
                    np.asarray(p, np.float64) for p in gate_parameters(self.dumps.weights(), config)
                )
                g = raw_gate_decay(np.asarray(g, np.float64), a_log, dt_bias, config)
            inputs = (l2norm(q), l2norm(k), v, g, beta)
            return recurrence_fp64(inputs, case.cu_seqlens, case.initial_state)

        return self._derived.get(("kernel-truth", dtype, raw_gate), compute)

    def checkpoint_states(self, case: CaseData, dtype: str, precision: type[np.floating]) -> np.ndarray:
        """The state entering every `CHECKPOINT_CHUNK_SIZE`-token chunk of each sequence, [NT, H, D, D]
        in `chunk_starts`' order: the token recurrence in `precision` on the dumped kernel inputs of the
        `dtype` run (q, k l2-normalised in fp32 as the kernels get them, then widened exactly). float64
        is the truth of `kernel-chunk-checkpoints`, float32 its reference (the dump holds no reference's
        checkpoints: the plain fp32 recurrence, as `search`'s sets take for their kernels' reference)."""

        def compute() -> np.ndarray:
            q, k, v, g, beta = (self.expected(case, name, dtype) for name in KERNEL_INPUTS)
            inputs = (np.asarray(x, precision) for x in (l2norm(q), l2norm(k), v, g, beta))
            init = None if case.initial_state is None else np.asarray(case.initial_state, precision)
            return packed_chunk_start_states(*inputs, case.cu_seqlens, init, kinds.CHECKPOINT_CHUNK_SIZE)

        return self._derived.get(("checkpoints", dtype, np.dtype(precision).name), compute)

    def gradient_cotangents(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """The cotangents (do, dht) of the case's gradient checks in the `dtype` run (`truth.
        gradient_cotangents`)."""
        return self._derived.get(
            ("cotangents", dtype), lambda: gradient_cotangents(case, dtype, self.dumps.config)
        )

    def kernel_gradients(
        self, case: CaseData, dtype: str, precision: type[np.floating]
    ) -> dict[str, np.ndarray]:
        """The token recurrence's gradients in `precision` (`kda_spec.truth.packed_delta_rule_vjp`) on the
        dumped kernel inputs of the `dtype` run (q, k l2-normalised in fp32 as the kernels get them, then
        widened exactly), for the case's cotangents: float64 is the truth of the gradient checks, float32
        their reference where the dump holds no reference's gradients (`grad_chunk_*`): the plain fp32
        recurrence."""

        def compute() -> dict[str, np.ndarray]:
            q, k, v, g, beta = (self.expected(case, name, dtype) for name in KERNEL_INPUTS)
            inputs = (np.asarray(x, precision) for x in (l2norm(q), l2norm(k), v, g, beta))
            init = None if case.initial_state is None else np.asarray(case.initial_state, precision)
            do, dht = (np.asarray(x, precision) for x in self.gradient_cotangents(case, dtype))
            return packed_delta_rule_vjp(*inputs, case.cu_seqlens, init, do, dht)

        return self._derived.get(("kernel-gradients", dtype, np.dtype(precision).name), compute)

    def layer_cotangents(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """The cotangents (dout, dht) of the case's layer gradient checks in the `dtype` run (`truth.
        layer_cotangents`)."""
        return self._derived.get(
            ("layer cotangents", dtype), lambda: layer_cotangents(case, dtype, self.dumps.config)
        )

    def layer_gradients(
        self, case: CaseData, dtype: str, precision: type[np.floating]
    ) -> dict[str, np.ndarray]:
        """The layer's gradients in `precision` (`kda_spec.layer_vjp`) on the `dtype` run's inputs and
        weights of the case, for the case's layer cotangents, by check result (`layer_gradient_results`):
        float64 is the truth of the layer gradient checks, float32 their fp32 reference where the dump holds
        no reference's gradients (`grad_layer_*`): the same code in float32."""
        return self._layer_backward(case, dtype, precision)[0]

    def layer_gradient_scales(self, case: CaseData, dtype: str) -> dict[str, np.ndarray]:
        """Each weight gradient's rounding scale, by check result: the root of the sum of the squares of
        the terms the float64 gradient sums (`kda_spec.layer_vjp`'s `squares`)."""
        return self._layer_backward(case, dtype, np.float64)[1]

    def _layer_backward(
        self, case: CaseData, dtype: str, precision: type[np.floating]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        config = self.dumps.config

        def compute() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
            weights = run_weights(self.dumps.weights(), dtype, config)
            squares: dict[str, np.ndarray] | None = {} if precision == np.float64 else None  # the truth's
            grads = layer_vjp(
                weights, run_hidden_states(case.hidden_states, dtype), case.cu_seqlens, case.initial_state,
                config, *self.layer_cotangents(case, dtype), precision, squares,
            )  # fmt: skip
            scales = {
                f"d{name.removesuffix('.weight')}": np.sqrt(value) for name, value in (squares or {}).items()
            }
            return layer_gradient_results(grads, config), scales

        return self._derived.get(("layer-gradients", dtype, np.dtype(precision).name), compute)

    def gradient_spread(
        self, case: CaseData, spec: CheckSpec, tolerance: Tolerance, truth: np.ndarray
    ) -> ReductionSpread | None:
        """A layer weight gradient's spread: `SPREAD_DRAWS` draws of its float64 truth with every element
        moved by `gradient_spread_lambda · u · sqrt(Σ terms²)` with a random sign (u the run dtype's unit
        roundoff), measured against the truth under `tolerance`; None where the policy sets no
        `gradient_spread_lambda` for the dtype."""
        limits = self.policy.relative[spec.dtype]
        if not limits.gradient_spread_lambda:
            return None
        scale = (
            limits.gradient_spread_lambda
            * UNIT_ROUNDOFF[spec.dtype]
            * self.layer_gradient_scales(case, spec.dtype)[spec.of.result]
        )
        rng = np.random.default_rng(zlib.crc32(spec.id.encode()))
        moves = [scale * rng.choice((-1.0, 1.0), size=scale.shape) for _ in range(SPREAD_DRAWS)]
        errors = [error_vs_truth(truth + move, truth, tolerance) for move in moves]
        return spread_of([e.margin for e in errors], [e.nrmse for e in errors], moves, limits, gradient=True)

    def own_inputs_state(self, case: CaseData, dtype: str, precision: type[np.floating]) -> np.ndarray:
        """The final states [N, H, D, D] of the token recurrence in `precision` on the implementation's own
        kernel inputs: the q, k, v, g, beta its layer run of the `dtype` run exposes. float64 (q and k
        l2-normalised in float64) is the truth of `layer-kernel-state`, float32 (l2-normalised in fp32,
        as a kernel gets them) its reference: a plain fp32 recurrence on the same inputs.
        `CheckSkipped` when the layer exposes no final state or not all five inputs."""
        result = self.calls.layer(case, dtype)
        adapter = self.calls.adapter(dtype).name
        missing = [name for name in KERNEL_INPUTS if name not in result.intermediates]
        if result.final_state is None or missing:
            what = f"its kernel inputs {missing}" if missing else "its final recurrent state"
            raise CheckSkipped(f"adapter {adapter!r} does not expose {what}")
        # Not memoised with what the dump alone gives (`_derived`): it is the implementation's, which
        # `power` changes between runs on one case.
        q, k, v, g, beta = (np.asarray(result.intermediates[name], precision) for name in KERNEL_INPUTS)
        normalised = l2_normalised if precision == np.float64 else l2norm
        init = None if case.initial_state is None else np.asarray(case.initial_state, precision)
        _, states = packed_delta_rule(normalised(q), normalised(k), v, g, beta, case.cu_seqlens, init)
        return states

    def sides(self, case: CaseData, spec: CheckSpec) -> Sides:
        """The implementation's result and the reference of one check: its kind's function (`_SIDES`)."""
        return _SIDES[spec.kind](self, case, spec)

    def state_sides(self, case: CaseData, spec: CheckSpec, state: np.ndarray | None) -> Sides:
        """A final state of the layer against the dump's state of the layer's kernel path."""
        if state is None:
            name = self.calls.adapter(spec.dtype).name
            raise CheckSkipped(f"adapter {name!r} returns no final recurrent state")
        reference = self.expected(case, f"recurrent_state_{case.info.layer_kernel_path}", spec.dtype)
        return Sides(np.asarray(state), reference, spec.kind.axes)

    @staticmethod
    def expected(case: CaseData, name: str, dtype: str) -> np.ndarray:
        """The dump's result `name` of the `dtype` run; `CheckSkipped` when the dump has none."""
        value = case.result(name, dtype)
        if value is None:
            raise CheckSkipped(f"the dump has no {fmt.result_key(name, dtype)!r}")
        return value


# --------------------------------------------------------------------------------- sides by kind

SidesFunction = Callable[[CheckRunner, CaseData, CheckSpec], Sides]
_SIDES: dict[CheckKind, SidesFunction] = {}


def _sides_of(*of: CheckKind) -> Callable[[SidesFunction], SidesFunction]:
    """Register the function that computes the sides of the kinds `of`."""

    def register(function: SidesFunction) -> SidesFunction:
        for kind in of:
            _SIDES[kind] = function
        return function

    return register


@_sides_of(kinds.LAYER)
def _layer(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    out = runner.calls.layer(case, spec.dtype).out
    return Sides(out, runner.expected(case, "out", spec.dtype), spec.kind.axes)


@_sides_of(kinds.LAYER_STATE)
def _layer_state(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    return runner.state_sides(case, spec, runner.calls.layer(case, spec.dtype).final_state)


@_sides_of(kinds.LAYER_KERNEL_STATE)
def _layer_kernel_state(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    reference = runner.own_inputs_state(case, spec.dtype, np.float32)
    return Sides(runner.calls.layer(case, spec.dtype).final_state, reference, spec.kind.axes)


@_sides_of(kinds.KERNEL_CHUNK_GRAD, kinds.KERNEL_CHUNK_GRAD_H0)
def _kernel_gradient(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    name, dtype = spec.of.result, spec.dtype
    if not np.any(runner.kernel_gradients(case, dtype, np.float64)[name]):
        # dg of sequences of one token from zero states: the decay scales nothing
        raise CheckSkipped(f"the float64 truth of {name} is zero everywhere: no relative error to judge")
    reference = case.result(f"grad_chunk_{name}", dtype)  # the reference kernel's backward, where dumped
    if reference is None:
        reference = runner.kernel_gradients(case, dtype, np.float32)[name]
    actual = runner.calls.kernel_vjp_on_dump(case, dtype, runner.gradient_cotangents(case, dtype))[name]
    return Sides(actual, reference, spec.kind.axes[: reference.ndim])


@_sides_of(kinds.LAYER_GRAD_X, kinds.LAYER_GRAD_H0, kinds.LAYER_GRAD_WEIGHT)
def _layer_gradient(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    name, dtype = spec.of.result, spec.dtype
    reference = case.result(f"grad_layer_{name}", dtype)  # the reference layer's backward, where dumped
    if reference is None and dtype != "fp32":
        raise CheckSkipped(
            f"no {dtype} reference of the layer's gradients: the dump holds none "
            f"({fmt.result_key(f'grad_layer_{name}', dtype)!r}), and a {dtype} backward's roundings have no "
            "float32 stand-in"
        )
    if not np.any(runner.layer_gradients(case, dtype, np.float64)[name]):
        raise CheckSkipped(f"the float64 truth of {name} is zero everywhere: no relative error to judge")
    if reference is None:
        reference = runner.layer_gradients(case, dtype, np.float32)[name]
    actual = runner.calls.layer_vjp_on_dump(case, dtype, runner.layer_cotangents(case, dtype))[name]
    return Sides(actual, reference, spec.kind.axes)


@_sides_of(kinds.KERNEL_CHUNK_CAUSAL)
def _kernel_causal(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    dtype = spec.dtype
    arguments = kernel_arguments(case, runner.calls.dumped_kernel_inputs(case, dtype))
    before, _ = runner.calls.kernel_on_dump(case, dtype, "chunk")

    def breaks(position: int) -> np.ndarray:
        after, _ = runner.calls.kernel_on(case, dtype, "chunk", changed_from(arguments, position))
        return changed_bits(before, after, position)

    return _causality(case, breaks, kinds.HEAD_AXES)


@_sides_of(kinds.KERNEL_CHUNK_GRAD_CAUSAL)
def _kernel_gradient_causal(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    dtype = spec.dtype
    arguments = kernel_arguments(case, runner.calls.dumped_kernel_inputs(case, dtype))
    do, dht = runner.gradient_cotangents(case, dtype)
    names = tuple(f"d{name}" for name in kinds.GRADIENT_INPUTS)

    def breaks(position: int) -> np.ndarray:
        cotangents = cotangents_before(do, dht, case.cu_seqlens, position)
        before = runner.calls.run_kernel_vjp(case, dtype, arguments, cotangents)
        after = runner.calls.run_kernel_vjp(case, dtype, changed_from(arguments, position), cotangents)
        return gradient_breaks(before, after, position, names)

    return _causality(case, breaks, kinds.HEAD_AXES)


@_sides_of(kinds.LAYER_CAUSAL)
def _layer_causal(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    dtype = spec.dtype
    before = np.asarray(runner.calls.layer(case, dtype).out)
    hidden_states = runner.calls.inputs(case, dtype)

    def breaks(position: int) -> np.ndarray:
        changed = hidden_states_changed_from(hidden_states, position)
        after = runner.calls.extend(dtype, changed, case.cu_seqlens, case.initial_state).out
        return changed_bits(before, after, position)

    return _causality(case, breaks, kinds.OUT_AXES)


@_sides_of(kinds.LAYER_GRAD_CAUSAL)
def _layer_gradient_causal(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    dtype = spec.dtype
    hidden_states = runner.calls.inputs(case, dtype)
    dout, dht = runner.layer_cotangents(case, dtype)

    def breaks(position: int) -> np.ndarray:
        cotangents = cotangents_before(dout, dht, case.cu_seqlens, position)
        changed = hidden_states_changed_from(hidden_states, position)
        before = runner.calls.run_layer_vjp(case, dtype, hidden_states, cotangents)
        after = runner.calls.run_layer_vjp(case, dtype, changed, cotangents)
        return layer_gradient_breaks(before, after, position)

    return _causality(case, breaks, kinds.OUT_AXES)


def _causality(case: CaseData, breaks: Callable[[int], np.ndarray], axes: tuple[str, ...]) -> Sides:
    """A causality check's sides: `breaks(P)` (1 where a result before P moved, or a gradient from P on
    is not zero) at each split position of the case (`causality.split_positions`), their maximum, against
    zeros; `CheckSkipped` for a 1-token case."""
    positions = split_positions(case.info.total_tokens)
    if not positions:
        raise CheckSkipped("a 1-token case has no position to split at")
    found = np.maximum.reduce([breaks(position) for position in positions])
    return Sides(found, np.zeros_like(found), axes)


@_sides_of(*kinds.KERNEL_KINDS, *kinds.RAW_GATE_KERNEL_KINDS)
def _kernel(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    kind, dtype = spec.kind, spec.dtype
    if kind in kinds.RAW_GATE_KERNEL_KINDS:
        o, state = runner.calls.raw_gate_kernel_on_dump(case, dtype, kind.kernel)
    else:
        o, state = runner.calls.kernel_on_dump(case, dtype, kind.kernel)
    if kind.result == "o":
        return Sides(o, runner.expected(case, f"o_kda_{kind.kernel}", dtype), kind.axes)
    return Sides(state, runner.expected(case, f"recurrent_state_{kind.kernel}", dtype), kind.axes)


@_sides_of(kinds.KERNEL_CHUNK_CHECKPOINTS)
def _checkpoints(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    actual = runner.calls.checkpoints_on_dump(case, spec.dtype)
    return Sides(actual, runner.checkpoint_states(case, spec.dtype, np.float32), spec.kind.axes)


@_sides_of(kinds.INTERMEDIATE)
def _intermediate(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    name, dtype = spec.of.result, spec.dtype
    reference = runner.expected(case, name, dtype)
    value = runner.calls.layer(case, dtype).intermediates.get(name)
    if value is None:
        raise CheckSkipped(f"adapter {runner.calls.adapter(dtype).name!r} does not expose {name!r}")
    return Sides(np.asarray(value), reference, spec.kind.axes[: reference.ndim])


@_sides_of(kinds.DECODE, kinds.DECODE_SELF)
def _decode(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    dtype = spec.dtype
    decoded, token_rows = runner.calls.decode(case, dtype, spec.of.decode_steps)
    if spec.kind == kinds.DECODE_SELF:
        reference = np.asarray(runner.calls.layer(case, dtype).out)[token_rows]
    else:
        reference = runner.expected(case, "out", dtype)[token_rows]
    return Sides(decoded, reference, spec.kind.axes, {"token": token_rows})


@_sides_of(kinds.CHUNKED_PREFILL, kinds.CHUNKED_PREFILL_STATE)
def _chunked_prefill(runner: CheckRunner, case: CaseData, spec: CheckSpec) -> Sides:
    out, state = runner.calls.chunked_prefill(case, spec.dtype)
    if spec.kind == kinds.CHUNKED_PREFILL:
        return Sides(out, runner.expected(case, "out", spec.dtype), spec.kind.axes)
    return runner.state_sides(case, spec, state)
