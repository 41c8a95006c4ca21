"""The checks: which ones a case gets, and how each result is computed and compared.

A check is one result of the implementation under test against one reference, for one case and
dtype: the layer output, a kernel output or state, an intermediate, a prefill→decode or chunked
prefill replay. `CheckRunner` computes them through the adapter, reusing one adapter per dtype and
each layer call for every check that needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from conformance.adapter import KDAAdapter, LayerResult
from conformance.adapters.guard import (
    CallShapes,
    CallWatchdog,
    FaultLog,
    GuardedAdapter,
    ImplementationFault,
    build_adapter,
    checked_kernel_result,
    checked_layer_result,
    read_only_weights,
)
from conformance.checks import sequences
from conformance.checks.truth import (
    COMPUTED_LAYER_TRUTH_SOURCE,
    CONTRACT_SOURCE,
    FP32_STAGES,
    KERNEL_INPUTS,
    NoTruth,
    computed_contract_model,
    computed_layer_truth,
    layer_kernel_truth,
    not_computed,
    recurrence_fp64,
    stored_truth,
)
from conformance.dumps.reader import CaseData, CaseInfo, DumpSet
from conformance.judging.metrics import (
    Attribution,
    Comparison,
    ContractCheck,
    StatisticRows,
    attribute,
    contract_check,
    judge,
    measure,
)
from conformance.judging.positions import (
    DECODE_POSITIONS,
    LAYER_POSITIONS,
    POSITION_CHECKS,
    PositionProfile,
    judge_by_windows,
    position_profile,
)
from conformance.judging.tolerances import CONTRACT_MODE, TolerancePolicy
from kda_spec import dump_format as fmt

# Kernel checks: check name → (kernel path as in the dump keys, which result).
KERNEL_CHECKS = {
    "kernel-chunk": ("chunk", "o"),
    "kernel-chunk-state": ("chunk", "state"),
    "kernel-recurrent": ("fused_recurrent", "o"),
    "kernel-recurrent-state": ("fused_recurrent", "state"),
}
GROUPS = ("layer", "kernel", "intermediate", "decode", "chunked")

_OUT_AXES = ("token", "channel")
_HEAD_AXES = ("token", "head", "channel")
_STATE_AXES = ("seq", "head", "key", "value")
KERNEL_TRUTH_SOURCE = "float64 recurrence on the dumped kernel inputs"


class CheckSkipped(Exception):
    """A check that cannot run here (nothing to compare with, or no such path in the adapter)."""


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    case_id: str
    dtype: str
    check: str

    @property
    def id(self) -> str:
        return f"{self.case_id}-{self.dtype}-{self.check}"

    @property
    def group(self) -> str:
        return group_of(self.check)


def group_of(check: str) -> str:
    """The column of the summary table a check belongs to."""
    if check in fmt.INTERMEDIATE_KEYS:
        return "intermediate"
    return next(group for group in GROUPS if check.startswith(group))


def case_checks(seq_lens: tuple[int, ...]) -> list[str]:
    """The names of the checks a case of these sequence lengths gets, per dtype."""
    decode_runs = [f"k{k}" for k in sequences.DECODE_STEPS]
    if max(seq_lens) <= sequences.DECODE_ALL_MAX_LEN:
        decode_runs.append("all")
    return [
        "layer",
        "layer-state",
        *KERNEL_CHECKS,
        *fmt.INTERMEDIATE_KEYS,
        *(f"decode-{run}{suffix}" for run in decode_runs for suffix in ("", "-self")),
        "chunked-prefill",
        "chunked-prefill-state",
    ]


def long_case_checks(info: CaseInfo) -> list[str]:
    """The checks of a long case (group `long`): its output by position
    (conformance/judging/positions.py), and the whole prefill and its state, or the decode steps the
    case asks for."""
    if info.decode_steps:
        return [f"decode-k{info.decode_steps}", DECODE_POSITIONS]
    return ["layer", "layer-state", LAYER_POSITIONS]


def plan(dumps: DumpSet, case_ids: list[str], dtypes: list[str]) -> list[CheckSpec]:
    """Every check of the selected cases and dtypes, ordered by case, then dtype."""
    infos = {case_id: dumps.cases[case_id] for case_id in case_ids}
    return [
        CheckSpec(case_id, dtype, check)
        for case_id, info in infos.items()
        for dtype in dtypes
        for check in (long_case_checks(info) if info.group == fmt.LONG_GROUP else case_checks(info.seq_lens))
    ]


def truth_name(check: str) -> str:
    """The stored truth a non-kernel check is judged against: the layer's output (decode and chunked
    prefill: its rows), its final recurrent state, or the intermediate of the check's name."""
    if check in fmt.INTERMEDIATE_KEYS:
        return check
    return "recurrent_state" if check.endswith("state") else "out"


def l2norm(x: np.ndarray) -> np.ndarray:
    """Per-head L2 normalisation in fp32, as the kernels expect q and k (kda-layer.md step 5)."""
    x = np.asarray(x, np.float32)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def _decode_run(check: str) -> int | None:
    """k of a `decode-k<k>[-self]` check; None for `decode-all[-self]`."""
    run = check.removeprefix("decode-").removesuffix("-self")
    return None if run == "all" else int(run[1:])


class CheckRunner:
    """Computes checks through one adapter per dtype, caching layer calls within the current case.

    Every adapter call goes through `conformance.adapters.guard` (copied arguments, checked results, faults
    logged in `faults`, each call watched by `watchdog` when there is one)."""

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
        self.adapter_class = adapter_class
        self.kernel = kernel
        self.policy = policy
        self.options = dict(options or {})  # the adapter's `--impl-option`s
        self.watchdog = watchdog
        self.faults = FaultLog()
        self.adapters: dict[str, KDAAdapter] = {}
        self._guarded: dict[str, GuardedAdapter] = {}
        self._adapter_faults: dict[str, ImplementationFault] = {}
        self._case: CaseData | None = None
        self._memo: dict[tuple[Any, ...], Any] = {}
        self.position_profiles: dict[str, PositionProfile] = {}  # by check id: the long cases' windows

    # ------------------------------------------------------------------------------------- resources

    def weights(self) -> dict[str, np.ndarray]:
        """The dump's float32 weights (read-only; `DumpSet` reads and checks them once)."""
        return self.dumps.weights()

    def adapter(self, dtype: str) -> KDAAdapter:
        """The implementation for `dtype`, built once (from its own read-only copy of the weights); a
        failure to build it is an `ImplementationFault`, raised afresh to every check that needs it."""
        if dtype in self._adapter_faults:
            raise self._adapter_faults[dtype].fresh()
        if dtype not in self.adapters:
            label = f"{self.adapter_class.__name__}(config, weights, {dtype!r}, {self.kernel!r})"
            args = (self.dumps.config, read_only_weights(self.weights()), dtype, self.kernel)
            try:
                adapter = build_adapter(
                    self.adapter_class, label, args, {"options": self.options}, self.faults
                )
            except ImplementationFault as fault:
                self._adapter_faults[dtype] = fault
                raise
            self.adapters[dtype] = adapter
            self._guarded[dtype] = GuardedAdapter(adapter, self.watchdog, self.faults)
        return self.adapters[dtype]

    def use_adapter(self, dtype: str, adapter: KDAAdapter) -> None:
        """Run the `dtype` checks on `adapter` from now on (`conformance power`'s injected ones)."""
        self.adapters[dtype] = adapter
        self._guarded[dtype] = GuardedAdapter(adapter, self.watchdog, self.faults)
        self._adapter_faults.pop(dtype, None)

    def case(self, case_id: str) -> CaseData:
        if self._case is None or self._case.info.case_id != case_id:
            self._memo.clear()
            self._case = None  # free the previous case before reading the next
            self._case = self.dumps.case(case_id)
        return self._case

    def _memoized(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """compute() once per case; a failure too, so that the checks sharing it do not repeat it (a
        fault or skip raised afresh to each, so that no traceback grows)."""
        if key not in self._memo:
            try:
                self._memo[key] = (True, compute())
            except Exception as err:
                self._memo[key] = (False, err)
        ok, value = self._memo[key]
        if ok:
            return value
        if isinstance(value, ImplementationFault):
            raise value.fresh()
        if isinstance(value, CheckSkipped):
            raise CheckSkipped(str(value))
        raise value

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
        limits = self.policy.relative[spec.dtype]
        attribution = attribute(actual, expected, truth_value, source, tolerance, limits, measured.apart)
        if mode != CONTRACT_MODE:
            return judge(measured, mode, attribution)
        try:
            contract = self.contract(
                case, spec, actual, expected, truth_value, attribution, positions, measured.gating
            )
        except NoTruth as missing:
            return judge(measured, mode, attribution, no_contract=str(missing))
        return judge(measured, mode, attribution, contract=contract)

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
        return contract_check(
            actual, expected, model, truth, impl_error, CONTRACT_SOURCE, limits, fp32_stage, gating
        )

    def contract_model(self, case: CaseData, spec: CheckSpec, positions: dict) -> np.ndarray:
        """The bf16 precision contract's float64 model of the check's result (its rows at `positions`);
        `NoTruth` when there is none (a kernel check, a result the model of a long case lacks)."""
        if spec.check in KERNEL_CHECKS:
            raise NoTruth("the precision contract has no rounding point inside the kernels")
        name = truth_name(spec.check)
        models = self._memoized(
            ("contract-model", spec.dtype),
            lambda: computed_contract_model(case, self.weights(), self.dumps.config),
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
            self.policy.relative[dtype],
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
            decoded, token_rows = self.decode(case, dtype, _decode_run(check))
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

    # -------------------------------------------------------------------------------- computations

    @staticmethod
    def inputs(case: CaseData, dtype: str) -> np.ndarray:
        """hidden_states as the run sees them: rounded to bf16 for the bf16 run."""
        if dtype == "bf16":
            return case.hidden_states.astype(ml_dtypes.bfloat16).astype(np.float32)
        return case.hidden_states

    def layer(self, case: CaseData, dtype: str) -> LayerResult:
        """One prefill of the whole case."""
        return self._memoized(
            ("layer", dtype),
            lambda: self._extend(dtype, self.inputs(case, dtype), case.cu_seqlens, case.initial_state),
        )

    def kernel_on_dump(self, case: CaseData, dtype: str, path: str) -> tuple[np.ndarray, np.ndarray]:
        """The chunk or recurrent kernel on the dumped q, k, v, g, beta of this run."""
        missing = [fmt.result_key(name, dtype) for name in KERNEL_INPUTS if case.result(name, dtype) is None]
        if missing:
            raise CheckSkipped(f"the dump has no {missing}: the kernel inputs are not in it")
        stages = {name: case.result(name, dtype) for name in KERNEL_INPUTS}
        return self._memoized(("kernel", dtype, path), lambda: self.run_kernel(case, dtype, path, stages))

    def run_kernel(
        self, case: CaseData, dtype: str, path: str, stages: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The `path` kernel ("chunk" or "fused_recurrent") on the conv outputs, g and beta in `stages`."""
        q, k, v, g, beta = (np.asarray(stages[name]) for name in KERNEL_INPUTS)
        method = "chunk_kernel" if path == "chunk" else "recurrent_kernel"
        arguments = {
            "q": l2norm(q), "k": l2norm(k), "v": v, "g": g, "beta": beta,
            "cu_seqlens": case.cu_seqlens, "initial_state": case.initial_state,
        }  # fmt: skip
        shapes = self._shapes(len(q), len(case.cu_seqlens) - 1)
        return self._call(dtype, method, arguments, checked_kernel_result, shapes)

    def decode(self, case: CaseData, dtype: str, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Prefill all but the last k tokens of each sequence, then decode k steps.

        Returns the decoded output rows and their token positions in the case. Sequences that need
        fewer steps than the longest one are fed zero tokens afterwards, whose outputs are ignored.
        """
        out, token_rows = self.decode_full(case, dtype, k)
        return out[token_rows], token_rows

    def decode_full(self, case: CaseData, dtype: str, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        """`decode`'s run with every output row: the prefill's, then the decoded ones (a long case's
        output by position); and the decoded rows' positions."""
        return self._memoized(("decode", dtype, k), lambda: self._decode(case, dtype, k))

    def _decode(self, case: CaseData, dtype: str, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        seq_lens, cu = case.info.seq_lens, case.cu_seqlens
        steps = sequences.decode_lengths(seq_lens, k)
        if max(steps) == 0:
            raise CheckSkipped("every sequence is 1 token long: no decode step follows a non-empty prefill")
        x = self.inputs(case, dtype)
        prefill = [(0, n - s) for n, s in zip(seq_lens, steps)]
        result = self._extend(
            dtype,
            sequences.gather(x, cu, prefill),
            sequences.offsets([n - s for n, s in zip(seq_lens, steps)]),
            case.initial_state,
        )
        out = np.zeros(x.shape, np.float32)
        out[sequences.rows(cu, prefill)] = result.out
        for step in range(max(steps)):
            positions = [cu[i] + seq_lens[i] - steps[i] + step for i in range(len(seq_lens))]
            live = [step < s for s in steps]
            tokens = np.stack([x[p] if on else np.zeros_like(x[0]) for p, on in zip(positions, live)])
            result = self._decode_step(dtype, tokens, self._carry(result, "decode"))
            decoded = result.out
            for i, (p, on) in enumerate(zip(positions, live)):
                if on:
                    out[p] = decoded[i]
        token_rows = sequences.rows(cu, [(n - s, n) for n, s in zip(seq_lens, steps)])
        return out, token_rows

    def chunked_prefill(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The case prefilled in pieces, each call continuing the last; (out [T, hidden], final states)."""
        return self._memoized(("chunked", dtype), lambda: self._chunked_prefill(case, dtype))

    def _chunked_prefill(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
        pieces = sequences.chunked_prefill_pieces(case.info.seq_lens)
        if len(pieces) < 2:
            raise CheckSkipped(
                f"the shortest sequence has {min(case.info.seq_lens)} token: every call needs a piece of each"
            )
        x, cu = self.inputs(case, dtype), case.cu_seqlens
        out = np.zeros(x.shape, np.float32)
        result = None
        for ranges in pieces:
            result = self._extend(
                dtype,
                sequences.gather(x, cu, ranges),
                sequences.offsets([hi - lo for lo, hi in ranges]),
                case.initial_state if result is None else None,
                None if result is None else self._carry(result, "chunked prefill"),
            )
            out[sequences.rows(cu, ranges)] = result.out
        return out, result.final_state

    def _extend(
        self,
        dtype: str,
        hidden_states: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
        carry: Any = None,
    ) -> LayerResult:
        """`layer_extend` on a packed batch (a prefill, or its next piece with `carry`), checked."""
        arguments = {
            "hidden_states": hidden_states, "cu_seqlens": cu_seqlens,
            "initial_state": initial_state, "carry": carry,
        }  # fmt: skip
        shapes = self._shapes(len(hidden_states), len(cu_seqlens) - 1)
        return self._call(dtype, "layer_extend", arguments, checked_layer_result, shapes)

    def _decode_step(self, dtype: str, tokens: np.ndarray, carry: Any) -> LayerResult:
        """`layer_decode` of one token per sequence of `carry`, checked."""
        arguments = {"hidden_states": tokens, "carry": carry}
        return self._call(
            dtype, "layer_decode", arguments, checked_layer_result, self._shapes(len(tokens), len(tokens))
        )

    def _carry(self, result: LayerResult, purpose: str) -> Any:
        """The carry to continue from; an adapter that returns none cannot continue a sequence."""
        if result.carry is None:
            raise CheckSkipped(f"adapter {self.adapter_class.name!r} returns no carry: no {purpose} path")
        return result.carry

    def _shapes(self, tokens: int, num_seqs: int) -> CallShapes:
        """The result shapes the contract fixes for a call of `tokens` tokens in `num_seqs` sequences."""
        return CallShapes(tokens, num_seqs, self.dumps.manifest["config"])

    def _call(
        self,
        dtype: str,
        method: str,
        arguments: dict[str, Any],
        check: Callable[[Any, str, CallShapes], Any],
        shapes: CallShapes,
    ) -> Any:
        """Call an adapter method through its guard, its result through `check(result, call, shapes)`;
        a path it lacks (NotImplementedError) skips the check, any other failure is an
        `ImplementationFault`."""
        self.adapter(dtype)  # built (or its fault raised) first
        try:
            return self._guarded[dtype].call(
                method, arguments, lambda result, call: check(result, call, shapes)
            )
        except NotImplementedError as err:
            raise CheckSkipped(str(err) or f"adapter has no {method}") from None
