"""Every call into the implementation under test goes through here: the adapter is untrusted.

- Arguments are fresh read-only copies of the suite's arrays; an adapter that changes one anyway (or
  fails writing into one) breaks the contract, and the fault names the call and the argument. Nothing
  an adapter writes can reach what the suite compares against.
- Results are validated before anything uses them (type, dtype, exact shape; NaN stays a result, for
  the comparison to fail) and copied, so that an adapter that later changes a buffer it returned
  changes nothing the suite holds.
- An exception becomes one `ImplementationFault`: one line per check that needed the call, the full
  traceback kept once per distinct fault (`FaultLog`).
- A call that runs past the call timeout ends the run through `CallWatchdog`.
- A method of a protocol the adapter's class does not declare is never called (`provided_calls`): it
  is a NotImplementedError naming the protocol, which skips the check as a path the adapter lacks does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from conformance.adapter import (
    KERNEL_GRADIENTS,
    LAYER_INPUT_GRADIENTS,
    KDAAdapter,
    LayerResult,
    own_traceback,
    provided_calls,
    unprovided,
)
from conformance.exit_codes import ExitCode
from kda_spec import dump_format as fmt

#: What the suite accepts as a float result: float32, or a dtype that float32 holds exactly.
EXACT_IN_FLOAT32 = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
#: The intermediates an adapter may return, by dump name; and `o_kda` [T, H, D], the kernel output the
#: layer itself computed (`conformance diff` shows it as the kernel stage inside the layer).
LAYER_KERNEL_OUTPUT = "o_kda"
INTERMEDIATE_NAMES = (*fmt.INTERMEDIATE_KEYS, *fmt.OPTIONAL_KEYS, LAYER_KERNEL_OUTPUT)
FAULT_KINDS = ("raised", "timeout", "contract")
#: `--call-timeout`'s default: far above any honest call on a 2-core CPU at the real preset (the longest,
#: a 16384-token prefill with its compile, takes well under a minute there).
DEFAULT_CALL_TIMEOUT_S = 900.0
_MESSAGE_LIMIT = 300


def one_line(text: str, limit: int = _MESSAGE_LIMIT) -> str:
    """`text` on one line, cut to `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ImplementationFault(Exception):
    """The implementation under test raised, timed out or broke the adapter contract in `call`.

    `kind` is one of FAULT_KINDS; `traceback_text` the adapter's own traceback (raised faults). A fault
    shared by several checks is raised to each as a `fresh()` copy, so that no traceback grows.
    """

    def __init__(self, kind: str, call: str, detail: str, traceback_text: str = ""):
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        self.kind, self.call, self.detail, self.traceback_text = kind, call, one_line(detail), traceback_text
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"implementation {self.kind}: {self.call}: {self.detail}"

    @property
    def key(self) -> tuple[str, str, str]:
        """What makes two faults the same one: kind, call and detail, any number in it aside (the same
        exception on a case of 8 tokens and on one of 65 is one fault)."""
        return self.kind, self.call, re.sub(r"\d+", "#", self.detail)

    def fresh(self) -> ImplementationFault:
        return ImplementationFault(self.kind, self.call, self.detail, self.traceback_text)


@dataclasses.dataclass
class FaultEntry:
    fault: ImplementationFault
    checks: list[str] = dataclasses.field(default_factory=list)
    calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.fault.kind,
            "call": self.fault.call,
            "message": self.fault.message,
            "calls": self.calls,
            "checks": self.checks,
            "traceback": self.fault.traceback_text,
        }


class FaultLog:
    """The distinct faults of a run, each with the checks it failed and how often a call hit it."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], FaultEntry] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add_call(self, fault: ImplementationFault) -> None:
        """A call that faulted (several checks may share it)."""
        self._entries.setdefault(fault.key, FaultEntry(fault)).calls += 1

    def add_check(self, fault: ImplementationFault, check_id: str) -> None:
        """A check that the fault failed."""
        entry = self._entries.setdefault(fault.key, FaultEntry(fault))
        if check_id not in entry.checks:
            entry.checks.append(check_id)

    def as_list(self) -> list[dict[str, Any]]:
        return [entry.as_dict() for entry in self._entries.values()]


# ----------------------------------------------------------------------------------------- arguments


def read_only_copy(value: Any) -> Any:
    """A fresh copy of a numpy argument that cannot be written through; anything else as it is."""
    if not isinstance(value, np.ndarray):
        return value
    copy = np.array(value, copy=True)
    copy.flags.writeable = False
    return copy


def read_only_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as the adapter's constructor gets them: its own read-only copies."""
    return {name: read_only_copy(array) for name, array in weights.items()}


def _same(before: np.ndarray, after: np.ndarray) -> bool:
    return np.array_equal(before, after, equal_nan=before.dtype.kind in "fc")


def _changed_arguments(originals: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    return [
        name
        for name, value in given.items()
        if isinstance(value, np.ndarray) and not _same(originals[name], value)
    ]


def _is_read_only_write(err: BaseException) -> bool:
    return isinstance(err, ValueError) and "read-only" in str(err)


def _traceback_of(err: BaseException) -> str:
    """The adapter's traceback, without this module's own frames."""
    return own_traceback(err, lambda name: name == __file__)


# ------------------------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class CallShapes:
    """The sizes the contract fixes for one call's results: T tokens of N sequences."""

    tokens: int
    num_seqs: int
    config: dict[str, Any]  # the dump manifest's config block

    def of(self, name: str) -> tuple[int, ...]:
        rule = "o_kda_chunk" if name == LAYER_KERNEL_OUTPUT else name  # the same [T, H, D]
        return fmt.expected_shape(rule, tokens=self.tokens, num_seqs=self.num_seqs, config=self.config)


def checked_array(value: Any, call: str, what: str, shape: tuple[int, ...]) -> np.ndarray:
    """`value` as the suite's own read-only float32 copy, or a contract fault naming the call, the
    result, the expected and the given type, dtype or shape."""
    if not (isinstance(value, np.ndarray) or hasattr(value, "__array__")):
        raise ImplementationFault(
            "contract",
            call,
            f"{what} must be an array (numpy, or one np.asarray reads), got {type(value).__name__}",
        )
    try:
        array = np.asarray(value)
    except Exception as err:  # the result's own __array__ failed
        raise ImplementationFault("contract", call, f"{what}: np.asarray failed: {err!r}") from None
    if array.dtype not in EXACT_IN_FLOAT32:
        raise ImplementationFault(
            "contract",
            call,
            f"{what} has dtype {array.dtype}; the contract is float32 (bfloat16, float16: upcast exactly)",
        )
    if array.shape != shape:
        raise ImplementationFault(
            "contract", call, f"{what} must have shape {list(shape)}, got {list(array.shape)}"
        )
    copy = np.array(array, dtype=np.float32, copy=True)
    copy.flags.writeable = False
    return copy


def checked_layer_result(value: Any, call: str, shapes: CallShapes) -> LayerResult:
    """A layer call's result, every array checked (`checked_array`); the carry passes as it is."""
    if not isinstance(value, LayerResult):
        raise ImplementationFault(
            "contract", call, f"must return a conformance.adapter.LayerResult, got {type(value).__name__}"
        )
    out = checked_array(value.out, call, "out", shapes.of("out"))
    state = value.final_state
    if state is not None:
        state = checked_array(state, call, "final_state", shapes.of("recurrent_state"))
    if not isinstance(value.intermediates, Mapping):
        raise ImplementationFault(
            "contract", call, f"intermediates must be a dict, got {type(value.intermediates).__name__}"
        )
    unknown = sorted(set(value.intermediates) - set(INTERMEDIATE_NAMES))
    if unknown:
        raise ImplementationFault(
            "contract",
            call,
            f"intermediates {unknown} are not dump names; accepted: {list(INTERMEDIATE_NAMES)}",
        )
    intermediates = {
        name: checked_array(array, call, f"intermediates[{name!r}]", shapes.of(name))
        for name, array in value.intermediates.items()
        if array is not None
    }
    return LayerResult(out=out, final_state=state, carry=value.carry, intermediates=intermediates)


def checked_kernel_result(value: Any, call: str, shapes: CallShapes) -> tuple[np.ndarray, np.ndarray]:
    """A kernel call's (o [T, H, V], final_state [N, H, K, V]), checked (`checked_array`)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ImplementationFault(
            "contract",
            call,
            f"must return a pair (o, final_state), got {type(value).__name__}"
            + (f" of {len(value)}" if isinstance(value, (tuple, list)) else ""),
        )
    o = checked_array(value[0], call, "o", shapes.of("o_kda_chunk"))
    return o, checked_array(value[1], call, "final_state", shapes.of("recurrent_state"))


def checked_checkpoints(value: Any, call: str, shapes: CallShapes) -> np.ndarray:
    """A checkpoint call's states [NT, H, K, V] (`shapes.num_seqs` is NT, the chunks), checked
    (`checked_array`)."""
    return checked_array(value, call, "checkpoints", shapes.of("recurrent_state"))


def checked_gradients(value: Any, call: str, shapes: CallShapes) -> dict[str, np.ndarray]:
    """A vjp call's gradients by `KERNEL_GRADIENTS` name, each checked (`checked_array`): dq, dk, dv, dg
    [T, H, D], dbeta [T, H], dh0 [N, H, K, V]."""
    if not isinstance(value, Mapping) or set(value) != set(KERNEL_GRADIENTS):
        given = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ImplementationFault(
            "contract", call, f"must return a dict of the gradients {list(KERNEL_GRADIENTS)}, got {given}"
        )
    rule = {"dbeta": "beta", "dh0": "recurrent_state"}
    return {
        name: checked_array(value[name], call, name, shapes.of(rule.get(name, "o_kda_chunk")))
        for name in KERNEL_GRADIENTS
    }


def checked_layer_gradients(
    value: Any, call: str, shapes: CallShapes, weight_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """A layer vjp call's gradients by name, each checked (`checked_array`): `hidden_states` [T, hidden],
    `initial_state` [N, H, K, V], and every weight of `weight_shapes` (its name → its shape)."""
    names = (*LAYER_INPUT_GRADIENTS, *weight_shapes)
    if not isinstance(value, Mapping) or set(value) != set(names):
        given = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ImplementationFault(
            "contract", call, f"must return a dict of the gradients {list(names)}, got {given}"
        )
    expected = {
        **weight_shapes,
        LAYER_INPUT_GRADIENTS[0]: shapes.of("hidden_states"),
        LAYER_INPUT_GRADIENTS[1]: shapes.of("recurrent_state"),
    }
    return {name: checked_array(value[name], call, name, expected[name]) for name in names}


# ---------------------------------------------------------------------------------------------- time


def checked_call_timeout(timeout_s: float) -> float:
    """`--call-timeout`, or a ValueError naming a value that is not a finite number of seconds >= 0."""
    if not (math.isfinite(timeout_s) and timeout_s >= 0):
        raise ValueError(
            f"--call-timeout must be a finite number of seconds >= 0 (0: no limit), got {timeout_s}"
        )
    return float(timeout_s)


class CallWatchdog:
    """Ends the run when one adapter call runs past `timeout_s` (0: never).

    The watchdog is a timer thread, so that it also fires while the call is stuck in native code (a
    deadlocked collective, a hung device) where no Python exception can reach it: `on_expiry(call,
    elapsed_s)` writes what the run has so far and returns lines for the user, and the process exits
    with `ExitCode.IMPLEMENTATION`.
    """

    def __init__(self, timeout_s: float, on_expiry: Callable[[str, float], list[str]] | None = None):
        self.timeout_s = checked_call_timeout(timeout_s)
        self.on_expiry = on_expiry
        # The real stderr, saved before pytest captures the file descriptors: the last words go there.
        self._stderr = os.dup(2) if timeout_s else None

    @contextlib.contextmanager
    def watching(self, call: str) -> Iterator[None]:
        if not self.timeout_s:
            yield
            return
        started = time.monotonic()
        timer = threading.Timer(self.timeout_s, self._expire, args=(call, started))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _expire(self, call: str, started: float) -> None:
        elapsed = time.monotonic() - started
        lines = [
            f"\nerror: implementation timeout: {call} did not return within {elapsed:.0f} s "
            f"(--call-timeout {self.timeout_s:g})"
        ]
        try:
            if self.on_expiry is not None:
                lines += self.on_expiry(call, elapsed)
        finally:
            if self._stderr is not None:
                os.write(self._stderr, "\n".join([*lines, ""]).encode())
            os._exit(ExitCode.IMPLEMENTATION)


# ----------------------------------------------------------------------------------------------- call


Validator = Callable[[Any, str], Any]


class GuardedAdapter:
    """Calls one adapter's methods with copied arguments and checked results (module docstring)."""

    def __init__(self, adapter: KDAAdapter, watchdog: CallWatchdog | None, faults: FaultLog | None):
        self.adapter, self.watchdog, self.faults = adapter, watchdog, faults
        self.provided = provided_calls(type(adapter))

    def call(self, method: str, arguments: Mapping[str, Any], validate: Validator) -> Any:
        """`adapter.method(*arguments)` (in order), its result through `validate(result, method)`, which
        raises an `ImplementationFault` for a result that breaks the contract.

        A method the adapter's class does not provide is a NotImplementedError naming its protocol
        (`unprovided`), without a call. NotImplementedError passes through (the suite skips the check);
        any other failure of the call is one `ImplementationFault`, logged once per call."""
        if method not in self.provided:
            raise NotImplementedError(unprovided(type(self.adapter), (method,)))
        call = method
        given = {name: read_only_copy(value) for name, value in arguments.items()}
        watch = self.watchdog.watching(call) if self.watchdog else contextlib.nullcontext()
        try:
            with watch:
                result = getattr(self.adapter, method)(*given.values())
        except NotImplementedError:
            raise
        except Exception as err:
            if _is_read_only_write(err):
                detail = (
                    f"wrote into a read-only argument (one of {list(arguments)}): {type(err).__name__}: {err}"
                )
                raise self._logged(
                    ImplementationFault("contract", call, detail, _traceback_of(err))
                ) from None
            detail = f"{type(err).__name__}: {err}"
            raise self._logged(ImplementationFault("raised", call, detail, _traceback_of(err))) from None
        changed = _changed_arguments(arguments, given)
        if changed:
            detail = f"wrote into its argument(s) {changed}: the suite's arguments are read-only"
            raise self._logged(ImplementationFault("contract", call, detail))
        try:
            return validate(result, call)
        except ImplementationFault as fault:
            raise self._logged(fault) from None

    def _logged(self, fault: ImplementationFault) -> ImplementationFault:
        if self.faults is not None:
            self.faults.add_call(fault)
        return fault


def build_adapter(
    factory: Callable[..., Any],
    label: str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    faults: FaultLog | None,
) -> Any:
    """`factory(*args, **kwargs)`, an exception in it one `raised` fault of call `label`."""
    try:
        return factory(*args, **kwargs)
    except Exception as err:
        fault = ImplementationFault("raised", label, f"{type(err).__name__}: {err}", _traceback_of(err))
    if faults is not None:
        faults.add_call(fault)
    raise fault
