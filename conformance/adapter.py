"""The adapter: how the suite drives an implementation under test (docs/adapters.md has a skeleton).

An adapter is a subclass of `KDAAdapter` that declares one or more of seven protocols, as bases, and
defines every method of each protocol it declares:

- `LayerAdapter`: `layer_extend`, `layer_decode` — the checks `layer`, `layer-state`, the intermediates,
  `decode-*`, `chunked-prefill[-state]`, a long case's by-position checks;
- `KernelAdapter`: `chunk_kernel`, `recurrent_kernel` — the `kernel-*` checks on the dumped gate `g`;
- `RawGateKernelAdapter` (optional): `chunk_kernel_raw_gate`, `recurrent_kernel_raw_gate` — the
  `kernel-*-rawgate[-state]` checks: the kernels computing the gate from its pre-activation input;
- `CheckpointKernelAdapter` (optional): `chunk_kernel_checkpoints` — the `kernel-chunk-checkpoints`
  check: the chunked kernel's state entering every chunk (fla's `return_intermediate_states`);
- `GradientAdapter` (optional): `chunk_kernel_vjp` — the `kernel-chunk-grad-*` checks and
  `kernel-chunk-grad-causal`: the chunked kernel's vector-Jacobian product, training's backward;
- `LayerGradientAdapter` (optional): `layer_vjp` — the `layer-grad-*` checks and `layer-grad-causal`: the
  layer's vector-Jacobian product, of its input, initial states and weights;
- `ServingAdapter`: `serving_open`, `serving_alloc`, `serving_free`, `serving_forward`, `serving_state`
  — the `serving-*` checks (those that compare a request with its run alone need the layer too) —
  and its optional verbs `serving_copy`, `serving_load`, `serving_accept` (with a forward of mode
  "verify"), each provided by defining it: a scenario that needs one the class does not define is skipped
  with that reason (`OPTIONAL_SERVING_CALLS`).

So `class Mine(LayerAdapter, KernelAdapter)`, and a kernel-only implementation is `class
Mine(KernelAdapter)`. What a class provides is decided from the class alone (`provided_calls`), when the
run is planned: a check that needs a call of a protocol the class does not declare (its kind's `needs`,
conformance/checks/kinds.py) is reported as skipped with that reason (`unprovided`), and nothing of it
is called. `load_adapter_class` refuses a class that declares no protocol, one that defines a
protocol's method without declaring the protocol, and one that leaves a method of a protocol it
declares undefined (`protocol_error`).

An adapter also says which KDA families (kda_spec.families: `kimi-linear`, `glm5-next`) it serves, in
`FAMILIES`; on a dump set of another family every check is skipped with that reason before it runs
(`unserved_family`), never passed. Without a `FAMILIES` of its own an adapter serves `kimi-linear`,
the one family there was before families.

It is named on the command line as `--impl package.module:Class`. The suite builds it once per run
dtype and reuses it for every check of that dtype:

    Class(config, weights, dtype, kernel, options=options)

- `config`: the dump's `kda_spec.config.KDAConfig`: H = `num_heads`, D = `head_dim` (keys and values
  both have D channels), P = H·D, W = `conv_size`; `family` and, for a lower-bound gate,
  `gate_lower_bound` L.
- `weights`: the layer's weights as float32 numpy arrays under their family's HF names and in torch's
  layout (Kimi-Linear: `q_proj.weight` [P, hidden], `q_conv1d.weight` [P, 1, W], `A_log` [1, 1, H, 1],
  `dt_bias` [P], ...; GLM-5.3-Flash: one `conv1d.weight` [3P, 1, W], `forget_gate.A_log` [H], ...;
  kda_spec.weight_names lists them with their shapes, `kda_spec.families.canonical_weights` maps any
  family's to Kimi-Linear's names). The adapter casts them for its run itself (a bf16 serving stack keeps
  `A_log` and `dt_bias` fp32, GLM's its conv too: `kda_spec.weight_names.fp32_weights`).
- `dtype`: `"fp32"` or `"bf16"`, the precision to run the implementation in.
- `kernel`: the `--kernel` value, `"auto"`, `"naive"` or `"pallas"`: which of the implementation's
  kernels to use — `naive` its plain (XLA / reference) kernels, `pallas` its Pallas ones, `auto` its own
  default. An adapter with one kernel may ignore it. `kernel_used` names what actually ran; the report
  prints it beside the request.
- `options`: the `--impl-option KEY=VALUE` pairs, as strings (`--tp N` / `--dp M` are the shorthands
  `tp=N` / `dp=M`). An adapter lists the keys it takes in `OPTIONS` and turns the strings into values
  in `parse_options`, which raises ValueError for an unknown key or a bad value; the command line calls
  it before the run, so that a bad option is a one-line usage error (exit 2).

`KDAAdapter`'s constructor checks `dtype` and the options and keeps the five as attributes of the same
names (`options` as `parse_options` returns them); an adapter's own constructor calls it first.

Arrays, in and out, are numpy. T is the number of tokens of a packed batch of N sequences;
`cu_seqlens` [N+1] int32 are their offsets (0, ..., T). Inputs are float32; in a bf16 run they hold
what the bf16 reference computed with (the hidden states rounded to bf16). Results are float32: a
bf16 result upcast exactly, so that the suite sees the implementation's own bf16 values.

A recurrent state is [N, H, K, V] float32 (K = V = D), in both runs: for each sequence and head the
matrix S with the key axis first and the value axis second, as the recurrence of kda-layer.md uses it.
Per token t (scale = D^-1/2, decay and keys on the key axis k, values on the value axis v):

    S'[k, v]  = exp(g_t[k]) · S[k, v]
    S[k, v]   = S'[k, v] + beta_t · k_t[k] · (v_t[v] - sum_k' k_t[k'] · S'[k', v])
    o_t[v]    = sum_k scale · q_t[k] · S[k, v]

What a method may raise: `NotImplementedError` (with a message) for a path the implementation has but
cannot serve here (a layer without decode, serving on a mesh of several data ranks, a kernel not on
this platform): every check that needs it is reported as skipped with the message, never as passed.
Any other exception is reported as an error of the checks that needed the call (the failing call is
not retried).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import re
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.dump_format import DTYPES
from kda_spec.extras import missing_extra
from kda_spec.families import FAMILIES, KIMI_LINEAR
from kda_spec.layer_vjp import HIDDEN_STATES_GRADIENT, INITIAL_STATE_GRADIENT
from kda_spec.truth import GRADIENT_NAMES


@dataclasses.dataclass
class LayerResult:
    """What one layer call returns.

    out:           [T, hidden] float32 (in a bf16 run: the bf16 values, upcast).
    final_state:   [N, H, K, V] float32 recurrent state of each sequence after the call (`KDAAdapter`
                   says which axis is which); None when the implementation cannot expose it (the state
                   checks then skip).
    carry:         whatever the adapter needs to continue these N sequences, in the order of the call's
                   `cu_seqlens`: at least each sequence's recurrent state and its short-conv state (the
                   last W-1 conv inputs, zeros where the sequence was shorter). The suite never looks
                   inside it and passes it back unchanged, to the same adapter only: to `layer_extend`
                   (`carry=`, the next piece of the same sequences) or to `layer_decode`. It must not
                   change after it is returned.
    intermediates: dump-named results of inner stages, where the implementation can expose them:
                   `q_after_conv`, `k_after_conv`, `v_after_conv` [T, H, D] (after the conv and silu,
                   before the l2 norm), `g` [T, H, D] and `beta` [T, H] (fp32 in both runs), `g_out`
                   [T, H, D] (before its sigmoid), `o_norm` [T, H, D] (before `o_proj`). A missing one
                   skips its check.
    """

    out: np.ndarray
    final_state: np.ndarray | None = None
    carry: Any = None
    intermediates: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class KDAAdapter:
    """The base of every adapter: its construction, options and report facts. Its calls are those of
    the protocols it declares (`LayerAdapter`, `KernelAdapter`, `RawGateKernelAdapter`,
    `CheckpointKernelAdapter`, `GradientAdapter`, `LayerGradientAdapter`, `ServingAdapter`); the module
    docstring is the contract."""

    #: A short name for reports.
    name: str = "unnamed"
    #: The `--impl-option` keys this adapter takes, each with a one-line description.
    OPTIONS: ClassVar[Mapping[str, str]] = {}
    #: The KDA families (`kda_spec.families` names) this adapter serves.
    FAMILIES: ClassVar[frozenset[str]] = frozenset({KIMI_LINEAR.name})

    def __init__(
        self,
        config: KDAConfig,
        weights: dict[str, np.ndarray],
        dtype: str,
        kernel: str = "auto",
        *,
        options: Mapping[str, str] | None = None,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.kernel = kernel
        self.options = self.parse_options(options or {})

    @classmethod
    def parse_options(cls, options: Mapping[str, str]) -> dict[str, Any]:
        """The `--impl-option` strings as this adapter's values; a ValueError names a key that is not in
        `OPTIONS` or a value that is bad. The base class checks the keys and keeps the strings: override
        it to convert and check the values (and call it for the keys)."""
        unknown = sorted(set(options) - set(cls.OPTIONS))
        if unknown:
            accepted = ", ".join(f"{key} ({text})" for key, text in cls.OPTIONS.items()) or "none"
            raise ValueError(f"adapter {cls.name!r} has no option {unknown}; it accepts: {accepted}")
        return dict(options)

    @property
    def kernel_used(self) -> str:
        """The kernel implementation actually in use (after any fallback), for the report."""
        return self.kernel

    def describe(self) -> dict[str, Any]:
        """Free-form facts for the report (versions, device, mesh, ...)."""
        return {}


class LayerAdapter(KDAAdapter, abc.ABC):
    """The layer protocol: a prefill of packed sequences and their decode, one token at a time."""

    @abc.abstractmethod
    def layer_extend(
        self,
        hidden_states: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None = None,
        carry: Any = None,
    ) -> LayerResult:
        """Prefill a packed batch of N sequences.

        hidden_states: [T, hidden] float32; cu_seqlens: [N+1] int32.
        initial_state: [N, H, K, V] float32 recurrent states of N fresh sequences (conv states zeros);
        carry: continue the N sequences of an earlier call instead (chunked prefill). The suite passes
        at most one of the two; with neither, every state starts at zeros.
        """

    @abc.abstractmethod
    def layer_decode(self, hidden_states: np.ndarray, carry: Any) -> LayerResult:
        """One token for each of the N sequences of `carry`: hidden_states [N, hidden].

        The suite decodes every sequence of the carry at each step; a sequence that has no token left is
        fed zeros, and its output is ignored. A layer without a decode path raises NotImplementedError.
        """


class KernelAdapter(KDAAdapter, abc.ABC):
    """The kernel protocol: the chunked and the token-recurrent kernel, on the dumped kernel inputs."""

    @abc.abstractmethod
    def chunk_kernel(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g: np.ndarray,
        beta: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The chunked kernel on a packed batch, fed what the reference kernel was fed.

        q, k [T, H, K]: the dumped conv outputs l2-normalised in fp32 (in a bf16 run too: not
        bf16-representable); v [T, H, V]: the dumped conv output (bf16 values in a bf16 run); g [T, H, K]
        and beta [T, H]: fp32; initial_state [N, H, K, V] fp32 or None (zeros).
        Returns (o [T, H, V], final_state [N, H, K, V]): o as the reference kernel returns it (rounded
        to bf16 in a bf16 run), the states fp32.
        """

    @abc.abstractmethod
    def recurrent_kernel(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g: np.ndarray,
        beta: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The token-recurrent kernel, same arguments and results as `chunk_kernel`."""


class RawGateKernelAdapter(KDAAdapter, abc.ABC):
    """The raw-gate kernel protocol: both kernels computing the log decay themselves from the gate's
    pre-activation input, the form fla's, sgl-jax's and tpu-inference's gated kernels take
    (`use_gate_in_kernel=True, A_log=..., dt_bias=...`, with `safe_gate=True, lower_bound=L` for a
    lower-bound family)."""

    @abc.abstractmethod
    def chunk_kernel_raw_gate(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g_raw: np.ndarray,
        beta: np.ndarray,
        a_log: np.ndarray,
        dt_bias: np.ndarray,
        lower_bound: float | None,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The chunked kernel on a packed batch, computing its gate in the kernel.

        q, k, v, beta, cu_seqlens, initial_state as for `KernelAdapter.chunk_kernel`; g_raw [T, H, K]:
        the gate's pre-activation input `f_b_proj(f_a_proj(x))`, before `dt_bias` (fp32 in the fp32 run,
        bf16 values in the bf16 run); a_log [H] and dt_bias [H·K] fp32; lower_bound: the family's L
        (`KDAConfig.gate_lower_bound`), None for Kimi-Linear's softplus gate. The log decay is
        `g = -exp(a_log[h]) * softplus(g_raw + dt_bias)`, or `L * sigmoid(exp(a_log[h]) * (g_raw +
        dt_bias))` with a lower bound L. Returns (o [T, H, V], final_state [N, H, K, V]) as
        `chunk_kernel` does.
        """

    @abc.abstractmethod
    def recurrent_kernel_raw_gate(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g_raw: np.ndarray,
        beta: np.ndarray,
        a_log: np.ndarray,
        dt_bias: np.ndarray,
        lower_bound: float | None,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The token-recurrent kernel, same arguments and results as `chunk_kernel_raw_gate`."""


class CheckpointKernelAdapter(KDAAdapter, abc.ABC):
    """The checkpoint kernel protocol: the chunked kernel's per-chunk states, read as checkpoints (fla's
    `chunk_kda(..., return_intermediate_states=True)`, vLLM's all-mode prefill, a prefix cache's
    snapshots at chunk boundaries)."""

    @abc.abstractmethod
    def chunk_kernel_checkpoints(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g: np.ndarray,
        beta: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
        chunk_size: int,
    ) -> np.ndarray:
        """The chunked kernel's state entering every chunk of `chunk_size` tokens of each sequence.

        q, k, v, g, beta, cu_seqlens, initial_state as for `KernelAdapter.chunk_kernel`; chunk_size: the
        tokens per chunk (the suite asks for 64, fla's default). Returns h [NT, H, K, V] float32 as fla
        returns it with `cu_seqlens` (its batch axis of 1 dropped): for each sequence in order, one state
        per chunk, ceil(T_i / chunk_size) of them (`kda_spec.truth.chunk_starts`), the c-th its state
        after its first c·chunk_size tokens, the first its initial state.
        """


# The gradients `GradientAdapter.chunk_kernel_vjp` returns, by name: those of the chunked kernel's inputs
# q, k, v, g, beta and initial_state (fla's names), as the float64 truth's (kda_spec.truth) names them.
KERNEL_GRADIENTS = GRADIENT_NAMES


class GradientAdapter(KDAAdapter, abc.ABC):
    """The gradient protocol: the chunked kernel's backward, as training calls it (fla's `chunk_kda`
    under autograd, a JAX kernel's `jax.vjp` or `custom_vjp`)."""

    @abc.abstractmethod
    def chunk_kernel_vjp(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g: np.ndarray,
        beta: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
        do: np.ndarray,
        dht: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """The chunked kernel's vector-Jacobian product on a packed batch: the gradients of
        `sum(o * do) + sum(final_state * dht)` with respect to its inputs.

        q, k, v, g, beta, cu_seqlens, initial_state as for `KernelAdapter.chunk_kernel` (q and k as the
        kernel gets them, already l2-normalised: their gradients are the kernel's, not the norm's);
        do [T, H, V] and dht [N, H, K, V] float32: the cotangents of the output and of the final states.
        Returns every name of `KERNEL_GRADIENTS`, float32: dq, dk [T, H, K], dv [T, H, V], dg [T, H, K],
        dbeta [T, H], dh0 [N, H, K, V] (of the initial states, zeros when there were none).
        """


# The gradients `LayerGradientAdapter.layer_vjp` returns beside one per weight: of the hidden states and of
# the initial recurrent states.
LAYER_INPUT_GRADIENTS = (HIDDEN_STATES_GRADIENT, INITIAL_STATE_GRADIENT)


class LayerGradientAdapter(KDAAdapter, abc.ABC):
    """The layer gradient protocol: the layer's backward, as training calls it (the layer under torch
    autograd, a JAX layer's `jax.vjp` or `nnx.grad`), of its input, initial states and weights."""

    @abc.abstractmethod
    def layer_vjp(
        self,
        hidden_states: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
        dout: np.ndarray,
        dht: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """The layer's vector-Jacobian product on a packed batch of N fresh sequences (conv states zeros):
        the gradients of `sum(out * dout) + sum(final_state * dht)`.

        hidden_states, cu_seqlens, initial_state as for `LayerAdapter.layer_extend`; dout [T, hidden] and
        dht [N, H, K, V] float32: the cotangents of the output and of the final recurrent states.
        Returns float32 arrays by name: `hidden_states` [T, hidden], `initial_state` [N, H, K, V] (of the
        initial states, of the zero states when there were none), and one per weight under the weight's
        own name and shape (`weights`' keys: the family's HF names, torch layout), the gradient of that
        weight as the run holds it (a bf16 run: of its bf16 copy).
        """


class ServingAdapter(KDAAdapter, abc.ABC):
    """The serving protocol (docs/serving.md): the implementation's own state pool, driven as a
    scheduler drives it."""

    @abc.abstractmethod
    def serving_open(self, num_slots: int) -> None:
        """Open a fresh state pool of `num_slots` request slots (replacing any earlier one), all free."""

    @abc.abstractmethod
    def serving_alloc(self) -> int:
        """A free slot of the pool for a new request: an int the other serving calls name it by. The
        slot may hold a finished request's states: a request with prefix length 0 must not see them."""

    @abc.abstractmethod
    def serving_free(self, slot: int) -> None:
        """Return `slot` (its request finished) to the pool's free slots."""

    @abc.abstractmethod
    def serving_forward(
        self,
        mode: str,
        hidden_states: np.ndarray,
        seq_lens: np.ndarray,
        slots: np.ndarray,
        prefix_lens: np.ndarray,
        padding_rows: int,
    ) -> np.ndarray:
        """One forward of a scheduled batch of N requests, each continuing from its slot's states.

        mode: "extend" (any token counts: prefills, their next chunks, running requests' next token)
        or "decode" (one token each). hidden_states: [T, hidden] float32, the requests' tokens packed
        in order, then `padding_rows` rows the scheduler added that belong to no request (decode: one
        padding request per row); T = sum(seq_lens) + padding_rows. seq_lens, slots, prefix_lens: [N]
        int64: each request's tokens in this forward, its slot, and the tokens it processed before
        (0: a new request, which starts from zero states). Returns out [T, hidden] float32 (padding
        rows: anything). A padding row must change no slot's state.
        """

    @abc.abstractmethod
    def serving_state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The states `slot` holds now: (recurrent [H, K, V] float32, conv [W-1, 3P] float32: the
        last W-1 inputs of the q | k | v short convs, in the run dtype's values)."""

    # --- optional verbs: an adapter provides one by defining it (`provided_calls`) --------------------

    def serving_copy(self, src: int, dst: int) -> None:
        """Give `dst` (a slot allocated for a new request) `src`'s recurrent and conv states: a prefix
        cache hit's copy-on-write of a snapshot. `src` keeps its states."""
        raise NotImplementedError(_optional_verb(self, "serving_copy"))

    def serving_load(self, slot: int, recurrent: np.ndarray, conv: np.ndarray) -> None:
        """Write `slot`'s states (the import of a disaggregated prefill: `serving_state` is the export):
        recurrent [H, K, V] float32, conv [W-1, 3P] float32 as `serving_state` returns them."""
        raise NotImplementedError(_optional_verb(self, "serving_load"))

    def serving_accept(self, slot: int, accepted: int) -> None:
        """Keep `slot`'s states after the first `accepted` draft tokens of its last verify forward
        (`serving_forward(mode="verify")`: each request's draft tokens from its slot's states, an output
        for every draft token, the slot unchanged until this call), its conv window included; 0 keeps
        the states from before the verify. An adapter that defines it serves mode "verify"."""
        raise NotImplementedError(_optional_verb(self, "serving_accept"))


#: The serving protocol's optional verbs: provided by an adapter class that defines them.
OPTIONAL_SERVING_CALLS = ("serving_copy", "serving_load", "serving_accept")


def _optional_verb(adapter: KDAAdapter, call: str) -> str:
    return f"adapter {adapter.name!r} does not define {call} (an optional verb of {__name__}.ServingAdapter)"


#: The protocols, in the order reasons name them; a protocol `FooBarAdapter` is named "foo-bar".
PROTOCOLS: tuple[type[KDAAdapter], ...] = (
    LayerAdapter, KernelAdapter, RawGateKernelAdapter, CheckpointKernelAdapter, GradientAdapter,
    LayerGradientAdapter, ServingAdapter,
)  # fmt: skip


def protocol_name(protocol: type[KDAAdapter]) -> str:
    """How reasons name a protocol: `RawGateKernelAdapter` → "raw-gate-kernel"."""
    return re.sub(r"(?<!^)(?=[A-Z])", "-", protocol.__name__.removesuffix("Adapter")).lower()


def protocol_calls(protocol: type[KDAAdapter]) -> tuple[str, ...]:
    """A protocol's calls: its abstract methods, in the order it defines them."""
    return tuple(
        name for name, value in vars(protocol).items() if getattr(value, "__isabstractmethod__", False)
    )


def provided_calls(adapter_class: type[KDAAdapter]) -> frozenset[str]:
    """The adapter methods a class provides: the calls of every protocol it declares (subclasses), and
    the optional serving verbs it defines (overrides)."""
    declared = {
        call
        for protocol in PROTOCOLS
        if issubclass(adapter_class, protocol)
        for call in protocol_calls(protocol)
    }
    optional = {
        call
        for call in OPTIONAL_SERVING_CALLS
        if issubclass(adapter_class, ServingAdapter)
        and getattr(adapter_class, call) is not getattr(ServingAdapter, call)
    }
    return frozenset(declared | optional)


def unprovided(adapter_class: type[KDAAdapter], calls: Iterable[str]) -> str | None:
    """Why an adapter of this class cannot make `calls`: each protocol of theirs it does not declare,
    named (`adapter 'x' implements no layer protocol (conformance.adapter.LayerAdapter)`), then each
    optional serving verb it does not define; None when it provides them all."""
    wanted = set(calls) - provided_calls(adapter_class)
    missing = [
        f"no {protocol_name(protocol)} protocol ({__name__}.{protocol.__name__})"
        for protocol in PROTOCOLS
        if not issubclass(adapter_class, protocol)
        and wanted
        & {*protocol_calls(protocol), *(OPTIONAL_SERVING_CALLS if protocol is ServingAdapter else ())}
    ]
    verbs = [call for call in OPTIONAL_SERVING_CALLS if call in wanted]
    if verbs and issubclass(adapter_class, ServingAdapter):  # else named with the serving protocol
        missing.append(
            f"no {', '.join(verbs)} (optional verb(s) of the serving protocol, {__name__}.ServingAdapter)"
        )
    return f"adapter {adapter_class.name!r} implements {' and '.join(missing)}" if missing else None


def unserved_family(adapter_class: type[KDAAdapter], config: KDAConfig) -> str | None:
    """Why an adapter of this class runs no check of a dump set of `config`'s family; None when it
    serves that family."""
    if config.family in adapter_class.FAMILIES:
        return None
    return (
        f"adapter {adapter_class.name!r} serves the {', '.join(sorted(adapter_class.FAMILIES))} family, not "
        f"this dump set's {config.family!r} ({config.kda_family.description}); an adapter that serves it "
        f"says so in FAMILIES"
    )


def protocol_error(adapter_class: type[KDAAdapter]) -> str | None:
    """What makes a subclass of `KDAAdapter` unusable as an adapter, in one line naming it: it declares
    no protocol; it defines a protocol's method without declaring that protocol (the suite would never
    call it); it leaves a method of a protocol it declares undefined; or its FAMILIES is not a non-empty
    set of known families. None when it is usable."""
    name = adapter_class.__qualname__
    declared = [protocol for protocol in PROTOCOLS if issubclass(adapter_class, protocol)]
    for protocol in PROTOCOLS:
        defined = [call for call in protocol_calls(protocol) if hasattr(adapter_class, call)]
        if protocol not in declared and defined:
            return (
                f"class {name!r} defines {', '.join(defined)} but does not declare {__name__}."
                f"{protocol.__name__} among its bases, so the suite would never call them"
            )
    if not declared:
        names = ", ".join(f"{__name__}.{protocol.__name__}" for protocol in PROTOCOLS)
        return f"class {name!r} implements no adapter protocol: subclass one or more of {names}"
    undefined = sorted(getattr(adapter_class, "__abstractmethods__", ()))
    if undefined:
        return f"class {name!r} does not define {', '.join(undefined)} of the protocols it declares"
    families = adapter_class.FAMILIES
    if not isinstance(families, (set, frozenset)) or not families or set(families) - set(FAMILIES):
        return f"class {name!r} has FAMILIES={families!r}: expected a non-empty set of {sorted(FAMILIES)}"
    return None


# The `kernel` argument's values (`--kernel`): the implementation's own default, its plain kernels, its
# Pallas ones.
KERNEL_CHOICES = ("auto", "naive", "pallas")
BUILTIN_ADAPTERS = {"kda_impl": "conformance.adapters.kda_impl_adapter:KDAImplAdapter"}


def own_traceback(err: BaseException, hidden: Callable[[str], bool]) -> str:
    """`err`'s traceback as Python prints it, without the frames whose file name `hidden` accepts: an
    implementation's own traceback, the suite's frames and Python's import machinery left out, so that
    what a user reads starts and ends in their code."""
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not hidden(frame.filename)]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    return "".join([*lines, *traceback.format_exception_only(type(err), err)])


class AdapterImportError(Exception):
    """The adapter's module exists but raised while it was imported (a syntax error, an exception at
    import time, a dependency of its own that is missing): a fault of the implementation under test.
    `traceback_text` is its own traceback, without the import machinery's frames."""

    def __init__(self, spec: str, module_name: str, err: BaseException):
        super().__init__(f"--impl {spec!r}: importing {module_name!r} raised {type(err).__name__}: {err}")
        machinery = (__file__, importlib.__file__)
        self.traceback_text = own_traceback(err, lambda name: name.startswith("<frozen") or name in machinery)


def _names_the_module(err: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the missing module is `module_name` itself (or a package above it), not one it imports."""
    return err.name is not None and (module_name == err.name or module_name.startswith(err.name + "."))


def load_adapter_class(spec: str) -> type[KDAAdapter]:
    """Resolve `kda_impl` or `package.module:Attr` to an adapter class, with a clear error: a ValueError
    when `spec` names nothing importable or a class that is no usable adapter (`protocol_error`), an
    `AdapterImportError` when its module raised on import, a `MissingExtra` when a built-in adapter
    lacks the extra that installs its implementation."""
    target = BUILTIN_ADAPTERS.get(spec, spec)
    if ":" not in target:
        raise ValueError(
            f"--impl {spec!r}: expected a built-in name {sorted(BUILTIN_ADAPTERS)} or 'package.module:Attr'"
        )
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = missing_extra(err, f"--impl {spec}") if spec in BUILTIN_ADAPTERS else None
        if missing is not None:  # a built-in adapter without its extra: the install's, not a fault
            raise missing from None
        if not _names_the_module(err, module_name):
            raise AdapterImportError(spec, module_name, err) from err
        raise ValueError(
            f"--impl {spec!r}: no module named {err.name!r} on the import path (the current folder first)"
        ) from err
    except Exception as err:
        raise AdapterImportError(spec, module_name, err) from err
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--impl {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, KDAAdapter)):
        raise ValueError(f"--impl {spec!r}: {attr!r} is not a subclass of conformance.adapter.KDAAdapter")
    error = protocol_error(cls)
    if error is not None:
        raise ValueError(f"--impl {spec!r}: {error}")
    return cls


def parse_option_pairs(pairs: list[str]) -> dict[str, str]:
    """`["tp=2", "mode=fast"]` (`--impl-option KEY=VALUE`, repeatable) → {"tp": "2", "mode": "fast"}; a
    ValueError names a pair without `=` or a key given twice."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--impl-option {pair!r}: expected KEY=VALUE")
        if key in options:
            raise ValueError(f"--impl-option {key!r} given twice ({options[key]!r}, {value!r})")
        options[key] = value
    return options
