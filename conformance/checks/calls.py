"""How the suite calls the implementation under test for a case: one prefill, the kernels on the
dumped inputs, prefill → decode, chunked prefill.

`ImplementationCalls` builds one adapter per dtype and calls it through `conformance.adapters.guard`
(copied arguments, checked results, faults logged in `faults`, each call watched by `watchdog` when
there is one); each result is computed once per case for every check that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    checked_checkpoints,
    checked_gradients,
    checked_kernel_result,
    checked_layer_gradients,
    checked_layer_result,
    read_only_weights,
)
from conformance.checks import sequences
from conformance.checks.catalogue import CheckSkipped
from conformance.checks.kinds import CHECKPOINT_CHUNK_SIZE
from conformance.checks.memo import Memo
from conformance.checks.truth import KERNEL_INPUTS
from conformance.dumps.reader import CaseData, DumpSet
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.families import canonical_weights
from kda_spec.gradients import layer_gradient_results
from kda_spec.truth import L2NORM_EPS, chunk_starts
from kda_spec.weight_names import hf_weight_shapes


def l2norm(x: np.ndarray) -> np.ndarray:
    """Per-head L2 normalisation in fp32, as the kernels expect q and k (kda-layer.md step 5)."""
    x = np.asarray(x, np.float32)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2NORM_EPS))


def _dumped_stages(case: CaseData, dtype: str, names: Sequence[str], absent: str) -> dict[str, np.ndarray]:
    """The `dtype` run's dumped results `names`; CheckSkipped naming those the dump lacks, with `absent`
    (what their absence means)."""
    missing = [fmt.result_key(name, dtype) for name in names if case.result(name, dtype) is None]
    if missing:
        raise CheckSkipped(f"the dump has no {missing}: {absent}")
    return {name: case.result(name, dtype) for name in names}


def kernel_arguments(case: CaseData, stages: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """A kernel call's arguments, in the kernel protocol's order, from the conv outputs, g and beta in
    `stages` (`KERNEL_INPUTS`): q and k l2-normalised, as the kernels get them; the case's packing and
    initial states."""
    q, k, v, g, beta = (np.asarray(stages[name]) for name in KERNEL_INPUTS)
    return {
        "q": l2norm(q), "k": l2norm(k), "v": v, "g": g, "beta": beta,
        "cu_seqlens": case.cu_seqlens, "initial_state": case.initial_state,
    }  # fmt: skip


def raw_gate_kernel_inputs() -> tuple[str, ...]:
    """The dump names of the raw-gate kernel's per-token inputs: the kernel's, the raw gate for `g`."""
    return tuple(fmt.GATE_INPUT_KEY if name == "g" else name for name in KERNEL_INPUTS)


def gate_parameters(weights: Mapping[str, np.ndarray], config: KDAConfig) -> tuple[np.ndarray, np.ndarray]:
    """`A_log` [H] and `dt_bias` [H·D], float32, from the dump's weights of any family (fla's layout
    of a raw-gate kernel's arguments)."""
    canonical = canonical_weights(config, weights)
    a_log = np.asarray(canonical["A_log"], np.float32).reshape(config.num_heads)
    return a_log, np.asarray(canonical["dt_bias"], np.float32).reshape(config.proj_dim)


class ImplementationCalls:
    """The implementation's results for the checks of one case at a time, each computed once."""

    def __init__(
        self,
        dumps: DumpSet,
        adapter_class: type[KDAAdapter],
        kernel: str,
        options: Mapping[str, str] | None = None,
        watchdog: CallWatchdog | None = None,
    ):
        self.dumps = dumps
        self.adapter_class = adapter_class
        self.kernel = kernel
        self.options = dict(options or {})  # the adapter's `--impl-option`s
        self.watchdog = watchdog
        self.faults = FaultLog()
        self.adapters: dict[str, KDAAdapter] = {}
        self._guarded: dict[str, GuardedAdapter] = {}
        self._adapter_faults: dict[str, ImplementationFault] = {}
        self._case: CaseData | None = None
        self._results = Memo()  # the current case's results

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

    def guarded(self, dtype: str) -> GuardedAdapter:
        """The guard around the `dtype` adapter (built, or its fault raised, first)."""
        self.adapter(dtype)
        return self._guarded[dtype]

    def case(self, case_id: str) -> CaseData:
        if self._case is None or self._case.info.case_id != case_id:
            self._results.clear()
            self._case = None  # free the previous case before reading the next
            self._case = self.dumps.case(case_id)
        return self._case

    def use_case(self, case: CaseData) -> None:
        """Call the implementation on `case` next, one the dump does not hold (a serving scenario's
        requests as a packed case); what was computed for another case is dropped."""
        if self._case is not case:
            self._results.clear()
            self._case = case

    def forget_results(self) -> None:
        """Forget the implementation's results of the current case (its adapter changed)."""
        self._results.clear()

    # -------------------------------------------------------------------------------- computations

    @staticmethod
    def inputs(case: CaseData, dtype: str) -> np.ndarray:
        """hidden_states as the run sees them: rounded to bf16 for the bf16 run."""
        if dtype == "bf16":
            return case.hidden_states.astype(ml_dtypes.bfloat16).astype(np.float32)
        return case.hidden_states

    def layer(self, case: CaseData, dtype: str) -> LayerResult:
        """One prefill of the whole case."""
        return self._results.get(
            ("layer", dtype),
            lambda: self.extend(dtype, self.inputs(case, dtype), case.cu_seqlens, case.initial_state),
        )

    @staticmethod
    def dumped_kernel_inputs(case: CaseData, dtype: str) -> dict[str, np.ndarray]:
        """The dumped q, k, v (conv outputs), g and beta of the `dtype` run; `CheckSkipped` when absent."""
        return _dumped_stages(case, dtype, KERNEL_INPUTS, "the kernel inputs are not in it")

    def kernel_on_dump(self, case: CaseData, dtype: str, path: str) -> tuple[np.ndarray, np.ndarray]:
        """The chunk or recurrent kernel on the dumped q, k, v, g, beta of this run."""
        stages = self.dumped_kernel_inputs(case, dtype)
        return self._results.get(("kernel", dtype, path), lambda: self.run_kernel(case, dtype, path, stages))

    def run_kernel(
        self, case: CaseData, dtype: str, path: str, stages: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The `path` kernel ("chunk" or "fused_recurrent") on the conv outputs, g and beta in `stages`."""
        return self.kernel_on(case, dtype, path, kernel_arguments(case, stages))

    def kernel_on(
        self, case: CaseData, dtype: str, path: str, arguments: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The `path` kernel ("chunk" or "fused_recurrent") on a call's `arguments` (`kernel_arguments`)
        of `case`'s packing."""
        method = "chunk_kernel" if path == "chunk" else "recurrent_kernel"
        shapes = self._shapes(len(arguments["q"]), len(case.cu_seqlens) - 1)
        return self._call(dtype, method, dict(arguments), checked_kernel_result, shapes)

    def checkpoints_on_dump(self, case: CaseData, dtype: str) -> np.ndarray:
        """The chunk kernel's state entering every `CHECKPOINT_CHUNK_SIZE`-token chunk of each sequence
        (`chunk_kernel_checkpoints`, [NT, H, D, D]) on the dumped q, k, v, g, beta of this run."""
        stages = _dumped_stages(case, dtype, KERNEL_INPUTS, "the kernel inputs are not in it")
        return self._results.get(("checkpoints", dtype), lambda: self.run_checkpoints(case, dtype, stages))

    def run_checkpoints(self, case: CaseData, dtype: str, stages: dict[str, np.ndarray]) -> np.ndarray:
        """`chunk_kernel_checkpoints` on the conv outputs, g and beta in `stages`."""
        arguments = {**kernel_arguments(case, stages), "chunk_size": CHECKPOINT_CHUNK_SIZE}
        chunks = chunk_starts(np.diff(case.cu_seqlens).tolist(), CHECKPOINT_CHUNK_SIZE)
        shapes = self._shapes(len(arguments["q"]), len(chunks))
        return self._call(dtype, "chunk_kernel_checkpoints", arguments, checked_checkpoints, shapes)

    def kernel_vjp_on_dump(
        self, case: CaseData, dtype: str, cotangents: tuple[np.ndarray, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The chunk kernel's gradients (`chunk_kernel_vjp`, by `KERNEL_GRADIENTS` name) on the dumped q,
        k, v, g, beta of this run, for the `cotangents` (do, dht) of its output and final states."""

        def run() -> dict[str, np.ndarray]:
            arguments = kernel_arguments(case, self.dumped_kernel_inputs(case, dtype))
            return self.run_kernel_vjp(case, dtype, arguments, cotangents)

        return self._results.get(("kernel vjp", dtype), run)

    def run_kernel_vjp(
        self,
        case: CaseData,
        dtype: str,
        arguments: Mapping[str, Any],  # a chunk kernel call's (`kernel_arguments`)
        cotangents: tuple[np.ndarray, np.ndarray],  # do [T, H, D], dht [N, H, D, D]
    ) -> dict[str, np.ndarray]:
        """`chunk_kernel_vjp` on the kernel call's `arguments` and the `cotangents`."""
        do, dht = cotangents
        shapes = self._shapes(len(arguments["q"]), len(case.cu_seqlens) - 1)
        return self._call(
            dtype, "chunk_kernel_vjp", {**arguments, "do": do, "dht": dht}, checked_gradients, shapes
        )

    def layer_vjp_on_dump(
        self, case: CaseData, dtype: str, cotangents: tuple[np.ndarray, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The layer's gradients (`layer_vjp`, by check result: `kda_spec.gradients.layer_gradient_results`)
        on the case's hidden states of this run, for the `cotangents` (dout, dht) of its output and final
        states."""
        return self._results.get(
            ("layer vjp", dtype),
            lambda: self.run_layer_vjp(case, dtype, self.inputs(case, dtype), cotangents),
        )

    def run_layer_vjp(
        self,
        case: CaseData,
        dtype: str,
        hidden_states: np.ndarray,  # [T, hidden]
        cotangents: tuple[np.ndarray, np.ndarray],  # dout [T, hidden], dht [N, H, D, D]
    ) -> dict[str, np.ndarray]:
        """`layer_vjp` on `hidden_states` in the case's sequences from its initial states, for the
        `cotangents`; its gradients by check result."""
        dout, dht = cotangents
        arguments = {
            "hidden_states": hidden_states, "cu_seqlens": case.cu_seqlens,
            "initial_state": case.initial_state, "dout": dout, "dht": dht,
        }  # fmt: skip
        config = self.dumps.config
        weight_shapes = hf_weight_shapes(config)

        def checked(value: Any, call: str, shapes: CallShapes) -> dict[str, np.ndarray]:
            return checked_layer_gradients(value, call, shapes, weight_shapes)

        shapes = self._shapes(len(hidden_states), len(case.cu_seqlens) - 1)
        return layer_gradient_results(self._call(dtype, "layer_vjp", arguments, checked, shapes), config)

    def raw_gate_kernel_on_dump(self, case: CaseData, dtype: str, path: str) -> tuple[np.ndarray, np.ndarray]:
        """The chunk or recurrent kernel's raw-gate form on the dumped q, k, v, raw gate and beta of this
        run, with the dump's `A_log` and `dt_bias` and the family's lower bound."""
        stages = _dumped_stages(
            case,
            dtype,
            raw_gate_kernel_inputs(),
            f"the raw-gate kernel inputs are not in it (a set written before dump_gen stored the raw gate "
            f"{fmt.GATE_INPUT_KEY!r})",
        )
        return self._results.get(
            ("raw-gate kernel", dtype, path), lambda: self.run_raw_gate_kernel(case, dtype, path, stages)
        )

    def run_raw_gate_kernel(
        self, case: CaseData, dtype: str, path: str, stages: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The `path` kernel's raw-gate form on the conv outputs, raw gate and beta in `stages`."""
        q, k, v, g_raw, beta = (np.asarray(stages[name]) for name in raw_gate_kernel_inputs())
        a_log, dt_bias = gate_parameters(self.weights(), self.dumps.config)
        method = "chunk_kernel_raw_gate" if path == "chunk" else "recurrent_kernel_raw_gate"
        arguments = {
            "q": l2norm(q), "k": l2norm(k), "v": v, "g_raw": g_raw, "beta": beta, "a_log": a_log,
            "dt_bias": dt_bias, "lower_bound": self.dumps.config.gate_lower_bound,
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
        return self._results.get(("decode", dtype, k), lambda: self._decode(case, dtype, k))

    def _decode(self, case: CaseData, dtype: str, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        seq_lens, cu = case.info.seq_lens, case.cu_seqlens
        steps = sequences.decode_lengths(seq_lens, k)
        prefill, calls = self._decode_run(case, dtype, k)
        out = np.zeros(self.inputs(case, dtype).shape, np.float32)
        out[sequences.rows(cu, [(0, n - s) for n, s in zip(seq_lens, steps)])] = prefill.out
        for positions, result in calls:
            out[positions] = result.out
        token_rows = sequences.rows(cu, [(n - s, n) for n, s in zip(seq_lens, steps)])
        return out, token_rows

    def chunked_prefill(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The case prefilled in pieces, each call continuing the last; (out [T, hidden], final states)."""
        return self._results.get(("chunked", dtype), lambda: self._chunked_prefill(case, dtype))

    def _chunked_prefill(self, case: CaseData, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
        return pieces_output(self.chunked_prefill_steps(case, dtype), self.inputs(case, dtype).shape)

    def extend(
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
        try:
            return self.guarded(dtype).call(
                method, arguments, lambda result, call: check(result, call, shapes)
            )
        except NotImplementedError as err:
            raise CheckSkipped(str(err) or f"adapter has no {method}") from None

    # ------------------------------------------------------------------ step by step (`conformance diff`)

    def decode_steps(self, case: CaseData, dtype: str, k: int | None) -> list[tuple[np.ndarray, LayerResult]]:
        """`decode`'s run (k steps; None: every token after the first) with the result of each decode
        step, at its rows of the sequences still decoding (the rest are zero tokens, left out of the
        result too), with the case's token positions of those rows."""
        return self._decode_run(case, dtype, k)[1]

    def _decode_run(
        self, case: CaseData, dtype: str, k: int | None
    ) -> tuple[LayerResult, list[tuple[np.ndarray, LayerResult]]]:
        """The prefill of all but the last k tokens of each sequence, and each decode step's result at
        the sequences still decoding, with their token positions; once per (dtype, k)."""
        return self._results.get(("decode-run", dtype, k), lambda: self._run_decode(case, dtype, k))

    def _run_decode(
        self, case: CaseData, dtype: str, k: int | None
    ) -> tuple[LayerResult, list[tuple[np.ndarray, LayerResult]]]:
        seq_lens, cu = case.info.seq_lens, case.cu_seqlens
        steps = sequences.decode_lengths(seq_lens, k)
        if max(steps) == 0:
            raise CheckSkipped("every sequence is 1 token long: no decode step follows a non-empty prefill")
        x = self.inputs(case, dtype)
        prefill = [(0, n - s) for n, s in zip(seq_lens, steps)]
        result = prefilled = self.extend(
            dtype,
            sequences.gather(x, cu, prefill),
            sequences.offsets([n - s for n, s in zip(seq_lens, steps)]),
            case.initial_state,
        )
        calls = []
        for step in range(max(steps)):
            positions = [int(cu[i] + seq_lens[i] - steps[i] + step) for i in range(len(seq_lens))]
            live = [i for i, s in enumerate(steps) if step < s]
            tokens = np.stack([x[p] if step < s else np.zeros_like(x[0]) for p, s in zip(positions, steps)])
            result = self._decode_step(dtype, tokens, self._carry(result, "decode"))
            calls.append((np.array([positions[i] for i in live]), _rows_of(result, live)))
        return prefilled, calls

    def chunked_prefill_steps(self, case: CaseData, dtype: str) -> list[tuple[np.ndarray, LayerResult]]:
        """`chunked_prefill`'s run with the result of every call: each piece with the case's token
        positions of its rows."""
        return self._results.get(("chunked-steps", dtype), lambda: self._chunked_prefill_steps(case, dtype))

    def _chunked_prefill_steps(self, case: CaseData, dtype: str) -> list[tuple[np.ndarray, LayerResult]]:
        pieces = sequences.chunked_prefill_pieces(case.info.seq_lens)
        if len(pieces) < 2:
            raise CheckSkipped(
                f"the shortest sequence has {min(case.info.seq_lens)} token: every call needs a piece of each"
            )
        return self.prefill_in_pieces(case, dtype, pieces)

    def prefill_in_pieces(
        self, case: CaseData, dtype: str, pieces: list[list[tuple[int, int]]]
    ) -> list[tuple[np.ndarray, LayerResult]]:
        """The case prefilled one call per entry of `pieces` (the (start, stop) token range of every
        sequence, relative to it: `sequences.chunked_prefill_pieces`, `sequences.pieces_of`), each call
        continuing the last one's carry (recurrent and conv states); every call's result with the case's
        token positions of its rows (`pieces_output` puts them together). Not kept: computed per call."""
        x, cu = self.inputs(case, dtype), case.cu_seqlens
        calls: list[tuple[np.ndarray, LayerResult]] = []
        for ranges in pieces:
            previous = calls[-1][1] if calls else None
            result = self.extend(
                dtype,
                sequences.gather(x, cu, ranges),
                sequences.offsets([hi - lo for lo, hi in ranges]),
                case.initial_state if previous is None else None,
                None if previous is None else self._carry(previous, "chunked prefill"),
            )
            calls.append((sequences.rows(cu, ranges), result))
        return calls


def pieces_output(
    calls: list[tuple[np.ndarray, LayerResult]], shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray | None]:
    """A prefill in pieces put together: (out [T, hidden] of `shape`, each row from the call that computed
    it; the last call's final states [N, H, D, D])."""
    out = np.zeros(shape, np.float32)
    for rows, result in calls:
        out[rows] = result.out
    return out, calls[-1][1].final_state


def _rows_of(result: LayerResult, rows: list[int]) -> LayerResult:
    """A decode step's result at the batch rows `rows`: its output and per-token intermediates, without
    its carry and final states (a long decode keeps every step's result)."""
    tokens = len(result.out)
    intermediates = {
        name: np.asarray(value)[rows]
        for name, value in result.intermediates.items()
        if np.ndim(value) and len(value) == tokens
    }
    return LayerResult(np.asarray(result.out)[rows], intermediates=intermediates)
