"""The kinds of check, one table: what each kind compares, with what, against which truth.

A check is one kind and, for the kinds whose name has a field, its argument: `decode-k8-self` is the
kind `decode-{run}-self` with the run of 8 decode steps, `serving-mixed-extend-state` the kind
`serving-{scenario}-state` of the scenario `mixed-extend`. Every reader — the plan, the sides and truth
of a check (`checks/runner.py`), its reduction (`checks/reductions.py`), the summary's columns, the
serving checks, the reports — reads the `CheckKind` of a `Check`; none takes a name apart. A name from
outside (a test, `search`'s replay, a reproducer) becomes a `Check` once, here (`parse_check`).

Adding a kind is one row of `KINDS` and the function that computes its sides (registered for the kind
in `checks/runner.py`, or in `checks/serving_checks.py` for a serving kind).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from kda_spec import dump_format as fmt
from kda_spec import gradients
from kda_spec.truth import GRADIENT_NAMES

OUT_AXES = ("token", "channel")
HEAD_AXES = ("token", "head", "channel")
STATE_AXES = ("seq", "head", "key", "value")
CONV_AXES = ("seq", "history", "channel")
CHECKPOINT_AXES = ("chunk", "head", "key", "value")  # fla's h: every sequence's chunks in order

# What the adapter methods a kind calls are (`CheckKind.needs`).
LAYER_CALLS = ("layer_extend",)
GRADIENT_CALLS = ("chunk_kernel_vjp",)
LAYER_GRADIENT_CALLS = ("layer_vjp",)
DECODE_CALLS = ("layer_extend", "layer_decode")
SERVING_CALLS = ("serving_open", "serving_alloc", "serving_free", "serving_forward", "serving_state")

# The truth a kind is judged against (`CheckKind.truth`).
LAYER_TRUTH = "layer"  # the float64 layer of the dump's inputs and weights (kda_spec.truth), at its rows
KERNEL_TRUTH = "kernel"  # the float64 recurrence on the dumped kernel inputs
# the float64 recurrence on the dumped kernel inputs, its log decay the float64 gate of the dumped raw gate
RAW_GATE_KERNEL_TRUTH = "kernel-raw-gate"
# the float64 recurrence on the dumped kernel inputs, its state entering every chunk of every sequence
CHECKPOINT_KERNEL_TRUTH = "kernel-checkpoints"
# the float64 recurrence on the implementation's own kernel inputs: the q, k, v, g, beta its layer exposes
OWN_INPUTS_TRUTH = "own-kernel-inputs"
# the float64 recurrence's vector-Jacobian product on the dumped kernel inputs (`kda_spec.truth.
# packed_delta_rule_vjp`, by `CheckRunner.kernel_gradients`)
GRADIENT_TRUTH = "kernel-gradients"
# the float64 layer's vector-Jacobian product on the dump's inputs and weights (`kda_spec.layer_vjp`, by
# `CheckRunner.layer_gradients`)
LAYER_GRADIENT_TRUTH = "layer-gradients"
# The chunk size the checkpoint check asks for: fla's default, at which fla and vLLM return their states.
CHECKPOINT_CHUNK_SIZE = 64

SERVING_GROUP = "serving"
TRAINING_GROUP = "training"  # what training needs: the gradients, causality
# The chunk kernel's per-token inputs whose gradients the `kernel-chunk-grad-{arg}` checks judge (the
# argument names the input; the gradient is `d<input>`, as `adapter.KERNEL_GRADIENTS` names it).
GRADIENT_INPUTS = tuple(name.removeprefix("d") for name in GRADIENT_NAMES if name != "dh0")
# The weights whose gradients the `layer-grad-{arg}` checks judge: every canonical weight (a fused conv's
# gradient judged as its q, k and v thirds), by its name without `.weight`.
LAYER_GRADIENT_WEIGHTS = gradients.LAYER_GRADIENT_WEIGHTS


@dataclasses.dataclass(frozen=True)
class CheckKind:
    """One kind of check.

    pattern:  its name; `{arg}` stands for its argument (the decode run, the intermediate, the scenario).
    group:    the column of the summary table it belongs to.
    needs:    the adapter methods its computation calls.
    result:   the layer result it is judged as: `out`, `recurrent_state`, an intermediate's dump name
              (`{arg}`: the argument's), or for a kernel kind the kernel's `o`, `state` or
              `checkpoints`.
    axes:     the axes of its two sides (an intermediate: the first as many as the reference has).
    truth:    `LAYER_TRUTH`, `KERNEL_TRUTH`, `RAW_GATE_KERNEL_TRUTH`, `CHECKPOINT_KERNEL_TRUTH`,
              `OWN_INPUTS_TRUTH`, `GRADIENT_TRUTH`, `LAYER_GRADIENT_TRUTH`, or None: judged by the absolute
              gate alone, `no_truth` says why.
    contract: whether the bf16 precision contract has a model of its result (no rounding point inside
              the kernels).
    kernel:   a kernel kind's path as in the dump's keys (`chunk`, `fused_recurrent`).
    """

    pattern: str
    group: str
    needs: tuple[str, ...]
    result: str
    axes: tuple[str, ...]
    truth: str | None = LAYER_TRUTH
    no_truth: str = ""
    contract: bool = True
    kernel: str | None = None

    def __post_init__(self) -> None:
        if (self.truth is None) != bool(self.no_truth):
            raise ValueError(f"kind {self.pattern!r}: no_truth is the reason for truth None, and only then")

    def __str__(self) -> str:
        return self.pattern

    @property
    def has_arg(self) -> bool:
        return "{arg}" in self.pattern

    def name(self, arg: str | None = None) -> str:
        """The check's name with this argument (None for a kind without one)."""
        if self.has_arg != (arg is not None):
            takes = "an" if self.has_arg else "no"
            raise ValueError(f"kind {self.pattern!r} takes {takes} argument, got {arg!r}")
        return self.pattern.replace("{arg}", arg) if arg is not None else self.pattern

    def result_of(self, arg: str | None) -> str:
        """The layer result a check of this kind is judged as (its stored truth's name), or the kernel
        result (`d{arg}`: the gradient of the input the argument names)."""
        return self.result.replace("{arg}", arg) if arg is not None else self.result


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of a case or scenario: its kind and its argument."""

    kind: CheckKind
    arg: str | None = None

    def __post_init__(self) -> None:
        self.kind.name(self.arg)  # the argument the kind takes

    @property
    def name(self) -> str:
        return self.kind.name(self.arg)

    @property
    def result(self) -> str:
        """The layer result it is judged as (`CheckKind.result_of`)."""
        return self.kind.result_of(self.arg)

    @property
    def decode_steps(self) -> int | None:
        """The decode steps of a decode check's run: `k8` → 8; None for `all` (every token)."""
        if self.arg is None or not self.arg.startswith("k"):
            return None
        return int(self.arg[1:])


def _kernel(path: str, label: str, which: str, raw_gate: bool = False) -> CheckKind:
    """A kernel's output (`which` "o") or final state ("state") on the dumped kernel inputs, against the
    reference kernel's; with `raw_gate`, its raw-gate form (`RawGateKernelAdapter`), fed the dumped raw
    gate `g_raw` with `A_log`, `dt_bias` and L in place of `g`."""
    state = which == "state"
    call = f"{'chunk' if path == 'chunk' else 'recurrent'}_kernel{'_raw_gate' if raw_gate else ''}"
    return CheckKind(
        pattern=f"kernel-{label}{'-rawgate' if raw_gate else ''}{'-state' if state else ''}",
        group="kernel",
        needs=(call,),
        result=which,
        axes=STATE_AXES if state else HEAD_AXES,
        truth=RAW_GATE_KERNEL_TRUTH if raw_gate else KERNEL_TRUTH,
        contract=False,
        kernel=path,
    )


# What each kind compares is the function registered for it (module docstring); in short, with the
# reference each is compared with:
# the dump's out, and the final state of the layer's kernel path;
LAYER = CheckKind("layer", "layer", LAYER_CALLS, "out", OUT_AXES)
LAYER_STATE = CheckKind("layer-state", "layer", LAYER_CALLS, "recurrent_state", STATE_AXES)
# the layer's final state against the float32 token recurrence on the layer's own kernel inputs (its
# q/k/v_after_conv, g, beta intermediates): what the layer's kernel path adds to the state, whatever
# rounding its projections drew;
LAYER_KERNEL_STATE = dataclasses.replace(
    LAYER_STATE, pattern="layer-kernel-state", truth=OWN_INPUTS_TRUTH, contract=False
)
# the reference kernels' results on the same inputs;
KERNEL_CHUNK = _kernel("chunk", "chunk", "o")
KERNEL_CHUNK_STATE = _kernel("chunk", "chunk", "state")
KERNEL_RECURRENT = _kernel("fused_recurrent", "recurrent", "o")
KERNEL_RECURRENT_STATE = _kernel("fused_recurrent", "recurrent", "state")
# the same results of the kernels' raw-gate form, on the dumped raw gate;
KERNEL_CHUNK_RAW_GATE = _kernel("chunk", "chunk", "o", raw_gate=True)
KERNEL_CHUNK_RAW_GATE_STATE = _kernel("chunk", "chunk", "state", raw_gate=True)
KERNEL_RECURRENT_RAW_GATE = _kernel("fused_recurrent", "recurrent", "o", raw_gate=True)
KERNEL_RECURRENT_RAW_GATE_STATE = _kernel("fused_recurrent", "recurrent", "state", raw_gate=True)
# the chunk kernel's state entering every 64-token chunk (`CheckpointKernelAdapter`), against the float32
# token recurrence's on the same inputs (the dump holds no reference's);
KERNEL_CHUNK_CHECKPOINTS = CheckKind(
    "kernel-chunk-checkpoints", "kernel", ("chunk_kernel_checkpoints",), "checkpoints", CHECKPOINT_AXES,
    truth=CHECKPOINT_KERNEL_TRUTH, contract=False, kernel="chunk",
)  # fmt: skip
# the chunk kernel's vector-Jacobian product on the dumped kernel inputs (`GradientAdapter`), the gradient
# of the input the argument names, and of the initial states (`-h0`), against the float32 token
# recurrence's (the dump holds no reference gradients);
KERNEL_CHUNK_GRAD = CheckKind(
    "kernel-chunk-grad-{arg}", TRAINING_GROUP, GRADIENT_CALLS, "d{arg}", HEAD_AXES, truth=GRADIENT_TRUTH,
    contract=False, kernel="chunk",
)  # fmt: skip
KERNEL_CHUNK_GRAD_H0 = dataclasses.replace(
    KERNEL_CHUNK_GRAD, pattern="kernel-chunk-grad-h0", result="dh0", axes=STATE_AXES
)
# the layer's vector-Jacobian product on the dump's hidden states and initial states (`LayerGradientAdapter`),
# the gradient of its input (`-x`), of its initial states (`-h0`), of the weight the argument names, against
# the float32 run of the float64 truth's code (the dump holds no reference gradients);
LAYER_GRAD_X = CheckKind(
    "layer-grad-x", TRAINING_GROUP, LAYER_GRADIENT_CALLS, "dx", OUT_AXES, truth=LAYER_GRADIENT_TRUTH,
    contract=False,
)  # fmt: skip
LAYER_GRAD_H0 = dataclasses.replace(LAYER_GRAD_X, pattern="layer-grad-h0", result="dh0", axes=STATE_AXES)
LAYER_GRAD_WEIGHT = dataclasses.replace(LAYER_GRAD_X, pattern="layer-grad-{arg}", result="d{arg}", axes=())
# causality (checks/causality.py): the chunk kernel's outputs before a position P, and (`-grad-`) its
# gradients with every cotangent from P on zero, against the same before the inputs from P on changed:
# equal to the bit (and the gradients from P on zero);
KERNEL_CHUNK_CAUSAL = CheckKind(
    "kernel-chunk-causal", TRAINING_GROUP, ("chunk_kernel",), "o before P", (), truth=None,
    no_truth="bit-exact: no float64 truth applies", contract=False,
)  # fmt: skip
KERNEL_CHUNK_GRAD_CAUSAL = dataclasses.replace(
    KERNEL_CHUNK_CAUSAL, pattern="kernel-chunk-grad-causal", needs=GRADIENT_CALLS, result="gradients before P"
)
# and the layer's output before P, after every hidden state from P on changed, and (`-grad-`) its
# gradients with every cotangent from P on zero;
LAYER_CAUSAL = dataclasses.replace(
    KERNEL_CHUNK_CAUSAL, pattern="layer-causal", needs=LAYER_CALLS, result="out before P", kernel=None
)
LAYER_GRAD_CAUSAL = dataclasses.replace(
    LAYER_CAUSAL, pattern="layer-grad-causal", needs=LAYER_GRADIENT_CALLS, result="gradients before P"
)
# the dump's intermediate of the argument's name;
INTERMEDIATE = CheckKind("{arg}", "intermediate", LAYER_CALLS, "{arg}", HEAD_AXES)
# the prefill of the rest, then one token a step: the dump's out at the decoded tokens, and (-self) the
# implementation's own prefill of the whole case there;
DECODE = CheckKind("decode-{arg}", "decode", DECODE_CALLS, "out", OUT_AXES)
DECODE_SELF = dataclasses.replace(DECODE, pattern="decode-{arg}-self")
# the case in three pieces, each call continuing the last: the dump's out and final state;
CHUNKED_PREFILL = CheckKind("chunked-prefill", "chunked", LAYER_CALLS, "out", OUT_AXES)
CHUNKED_PREFILL_STATE = dataclasses.replace(
    CHUNKED_PREFILL, pattern="chunked-prefill-state", result="recurrent_state", axes=STATE_AXES
)
# a long case's error by position (conformance/judging/positions.py), window by window: the prefill's
# output, or the output of a prefill followed by its `decode_steps` decode steps;
BY_POSITION_LAYER = CheckKind("layer-positions", "layer", LAYER_CALLS, "out", OUT_AXES)
BY_POSITION_DECODE = CheckKind("decode-positions", "decode", DECODE_CALLS, "out", OUT_AXES)
# each request of a scenario run alone (one layer_extend from zero states): its outputs, final
# recurrent state and final conv state;
SERVING = CheckKind("serving-{arg}", SERVING_GROUP, (*SERVING_CALLS, *LAYER_CALLS), "out", OUT_AXES)
SERVING_STATE = dataclasses.replace(
    SERVING, pattern="serving-{arg}-state", result="recurrent_state", axes=STATE_AXES
)
SERVING_CONV = dataclasses.replace(
    SERVING, pattern="serving-{arg}-conv", result="final_conv_state", axes=CONV_AXES, truth=None,
    no_truth="no float64 truth of the conv state", contract=False,
)  # fmt: skip
# the same states of the scenario's checkpoints (requests that only hold a copy of another's states at a
# boundary: a prefix cache's snapshot), against the prefix they hold run alone; `-state` and `-conv` judge
# every other request;
SERVING_CHECKPOINT = dataclasses.replace(SERVING_STATE, pattern="serving-{arg}-checkpoint")
SERVING_CHECKPOINT_CONV = dataclasses.replace(SERVING_CONV, pattern="serving-{arg}-checkpoint-conv")
# to the bit: the slots outside each batch before it, and the outputs of the scenario it is `same_as`.
SERVING_UNTOUCHED = CheckKind(
    "serving-{arg}-untouched", SERVING_GROUP, SERVING_CALLS, "slot states", (), truth=None,
    no_truth="bit-exact: no float64 truth applies", contract=False,
)  # fmt: skip
SERVING_IDENTICAL = dataclasses.replace(SERVING_UNTOUCHED, pattern="serving-{arg}-identical", result="out")
# to the bit: the poisoned slots (NaN, 1e30; held or free) around every call that runs on the pool.
SERVING_POISONED = dataclasses.replace(
    SERVING_UNTOUCHED, pattern="serving-{arg}-poisoned", result="slot bits"
)

KINDS = (
    LAYER,
    LAYER_STATE,
    LAYER_KERNEL_STATE,
    KERNEL_CHUNK,
    KERNEL_CHUNK_STATE,
    KERNEL_RECURRENT,
    KERNEL_RECURRENT_STATE,
    KERNEL_CHUNK_RAW_GATE,
    KERNEL_CHUNK_RAW_GATE_STATE,
    KERNEL_RECURRENT_RAW_GATE,
    KERNEL_RECURRENT_RAW_GATE_STATE,
    KERNEL_CHUNK_CHECKPOINTS,
    KERNEL_CHUNK_GRAD,
    KERNEL_CHUNK_GRAD_H0,
    KERNEL_CHUNK_CAUSAL,
    KERNEL_CHUNK_GRAD_CAUSAL,
    LAYER_GRAD_X,
    LAYER_GRAD_H0,
    LAYER_GRAD_WEIGHT,
    LAYER_CAUSAL,
    LAYER_GRAD_CAUSAL,
    INTERMEDIATE,
    DECODE,
    DECODE_SELF,
    CHUNKED_PREFILL,
    CHUNKED_PREFILL_STATE,
    BY_POSITION_LAYER,
    BY_POSITION_DECODE,
    SERVING,
    SERVING_STATE,
    SERVING_CONV,
    SERVING_CHECKPOINT,
    SERVING_CHECKPOINT_CONV,
    SERVING_UNTOUCHED,
    SERVING_IDENTICAL,
    SERVING_POISONED,
)
KERNEL_KINDS = (KERNEL_CHUNK, KERNEL_CHUNK_STATE, KERNEL_RECURRENT, KERNEL_RECURRENT_STATE)
RAW_GATE_KERNEL_KINDS = (
    KERNEL_CHUNK_RAW_GATE, KERNEL_CHUNK_RAW_GATE_STATE, KERNEL_RECURRENT_RAW_GATE,
    KERNEL_RECURRENT_RAW_GATE_STATE,
)  # fmt: skip
BY_POSITION_KINDS = (BY_POSITION_LAYER, BY_POSITION_DECODE)
SERVING_KINDS = tuple(kind for kind in KINDS if kind.group == SERVING_GROUP)
# What the serving kinds add after a scenario's name (a scenario's name never ends in one).
SERVING_SUFFIXES = tuple(k.pattern.removeprefix("serving-{arg}") for k in SERVING_KINDS if k != SERVING)
# The summary table's columns, in the table's order.
GROUPS = tuple(dict.fromkeys(kind.group for kind in KINDS))


def _regex(kind: CheckKind) -> re.Pattern[str]:
    """The names of `kind`: its pattern with `{arg}` matching the argument its kind allows."""
    arg = "|".join(map(re.escape, fmt.INTERMEDIATE_KEYS)) if kind is INTERMEDIATE else r"k\d+|all"
    if kind is KERNEL_CHUNK_GRAD:
        arg = "|".join(GRADIENT_INPUTS)
    if kind is LAYER_GRAD_WEIGHT:
        arg = "|".join(LAYER_GRADIENT_WEIGHTS)
    if kind.group == SERVING_GROUP:
        arg = r"\S+?"
    return re.compile(re.escape(kind.pattern).replace(re.escape("{arg}"), f"(?P<arg>{arg})"))


# Most specific first: a scenario's name may end as a serving kind's suffix does only where that kind
# does not apply.
_MATCHERS = tuple((kind, _regex(kind)) for kind in sorted(KINDS, key=lambda k: -len(k.pattern)))


@functools.lru_cache(maxsize=4096)
def parse_check(name: str) -> Check:
    """The check a name from outside names (`decode-k8-self`, `serving-mixed-extend-state`); a
    ValueError naming it and the kinds there are when no kind has that name."""
    for kind, regex in _MATCHERS:
        match = regex.fullmatch(name)
        if match:
            return Check(kind, match.groupdict().get("arg"))
    raise ValueError(f"no check is named {name!r}; the kinds are {[kind.pattern for kind in KINDS]}")
