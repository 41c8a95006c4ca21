"""The one place that picks a KDA kernel implementation (RFC §4.2).

`naive`  — plain JAX (`kda_impl.kernels.naive`), runs everywhere.
`pallas` — Pallas kernels (`kda_impl.kernels.pallas`), native on TPU; elsewhere they run only in
           interpret mode, which is how they are tested on CPU.
`auto`   — Pallas where it runs natively (TPU), plain JAX elsewhere, and plain JAX whenever the Pallas
           module cannot be imported, or the Pallas kernel does not lower at the call's own shapes: on
           TPU each call is first lowered (not run) at its argument shapes, dtypes and static options,
           once per such key; a failure is logged once per key, with the reason.

Choose with the `kernel=` argument of each function or the `KDA_KERNEL` environment variable
(`naive|pallas|auto`, default `auto`). `resolve_kernel()` says which implementation a call would use,
`kernel_choice()` what the calls so far used and how they ran (the conformance report's `kernel_used`):
`naive (xla, cpu)`, `pallas (mosaic, tpu)`, `pallas (interpret, cpu)`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import jax
import numpy as np

from kda_impl.kernels import naive

logger = logging.getLogger(__name__)

KERNEL_ENV = "KDA_KERNEL"
KERNEL_CHOICES = ("auto", "naive", "pallas")


@functools.cache
def _pallas_module() -> tuple[ModuleType | None, str]:
    """Import the Pallas kernels once; (module, "") or (None, why not)."""
    try:
        from kda_impl.kernels import pallas
    except ImportError as err:  # a missing Pallas build or TPU plugin
        return None, f"cannot import kda_impl.kernels.pallas: {err}"
    return pallas, ""


# Integer arguments that are runtime values of the kernels (prefetched or indexed), not compile-time
# options: a probe lowers them as i32[] so that each value does not lower, and cache, a kernel of its own.
_RUNTIME_SCALARS = frozenset({"layer_index"})


@dataclass(frozen=True)
class KernelCall:
    """One call of a dispatched kernel: its name in the Pallas module and its arguments (arrays or
    tracers, and static options), as the dispatcher passes them on."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def signature(self) -> tuple[Hashable, ...]:
        """The probe's cache key: the name, then each argument as ("array", shape, dtype) or ("static",
        value)."""
        keyed = tuple(_argument_key(value) for value in self.args)
        named = tuple(sorted((key, _argument_key(value, key)) for key, value in self.kwargs.items()))
        return (self.name, keyed, named)


def _argument_key(value: Any, name: str = "argument") -> tuple[Hashable, ...]:
    """("array", shape, dtype as JAX would hold it) or ("static", a hashable value)."""
    if name in _RUNTIME_SCALARS and isinstance(value, (int, np.integer)):
        return ("array", (), "int32")
    if isinstance(value, np.generic):  # a numpy scalar option, e.g. scale=np.float32(0.1)
        value = value.item()
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # an array, a tracer, a ShapeDtypeStruct
        return ("array", tuple(value.shape), str(jax.dtypes.canonicalize_dtype(value.dtype)))
    try:
        hash(value)
    except TypeError:
        raise ValueError(f"{name}={value!r:.80} is neither an array nor a hashable option") from None
    return ("static", value)


def _argument_spec(key: tuple[Hashable, ...]) -> Any:
    """What a probe lowers with, from `_argument_key`: a ShapeDtypeStruct, or the static value."""
    return jax.ShapeDtypeStruct(key[1], key[2]) if key[0] == "array" else key[1]


def _describe(signature: tuple[Hashable, ...]) -> str:
    """`name(float32[1,16,2,32], ..., scale=0.125)`: a probe key, for the log and the report."""

    def shown(key: tuple[Hashable, ...]) -> str:
        if key[0] != "array":
            return repr(key[1])
        return f"{key[2]}[{','.join(str(d) for d in key[1])}]"

    name, keyed, named = signature
    parts = [shown(key) for key in keyed] + [f"{arg}={shown(key)}" for arg, key in named]
    return f"{name}({', '.join(parts)})"


def lower_pallas_kernel(kernel: Callable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Lower (trace and compile to the backend's IR, not run) `kernel` for this backend; raises on failure.

    `args` and `kwargs` hold ShapeDtypeStructs for arrays and the static options as values."""
    static = {key: value for key, value in kwargs.items() if not isinstance(value, jax.ShapeDtypeStruct)}
    arrays = {key: value for key, value in kwargs.items() if key not in static}
    positional_static = [i for i, value in enumerate(args) if not isinstance(value, jax.ShapeDtypeStruct)]
    jax.jit(functools.partial(kernel, **static), static_argnums=positional_static).lower(*args, **arrays)


# KernelCall.signature() → "" or why the Pallas kernel does not lower there; each key probed once.
_probe_failures: dict[tuple[Hashable, ...], str] = {}


def _pallas_probe_failure(signature: tuple[Hashable, ...]) -> str:
    """The cached outcome of lowering the Pallas kernel of `signature`: "" or why it failed."""
    if signature not in _probe_failures:
        _probe_failures[signature] = _lower_at(signature)
    return _probe_failures[signature]


def _lower_at(signature: tuple[Hashable, ...]) -> str:
    """Lower the Pallas kernel of `signature` at its shapes, dtypes and static options; "" or why not."""
    module, why_not = _pallas_module()
    if module is None:
        return why_not
    name, keyed, named = signature
    args = tuple(_argument_spec(key) for key in keyed)
    kwargs = {arg: _argument_spec(key) for arg, key in named}
    try:
        lower_pallas_kernel(getattr(module, name), args, kwargs)
    except Exception as err:  # any lowering error means: do not use Pallas for this call
        where = f"{_describe(signature)} does not lower on {jax.default_backend()}"
        return f"{where}: {type(err).__name__}: {err}"
    return ""


def pallas_is_native() -> bool:
    """Whether Pallas kernels compile natively here (a TPU), rather than only in interpret mode."""
    return jax.default_backend() == "tpu"


@functools.cache
def _log_fallback_once(reason: str) -> None:
    logger.warning("KDA kernels: using plain JAX (naive) instead of Pallas: %s", reason)


def requested_kernel(kernel: str | None = None) -> str:
    """The requested choice: the argument, else $KDA_KERNEL, else 'auto'; validated."""
    choice = kernel if kernel is not None else os.environ.get(KERNEL_ENV, "auto")
    choice = choice.strip().lower()
    if choice not in KERNEL_CHOICES:
        source = "kernel argument" if kernel is not None else f"${KERNEL_ENV}"
        raise ValueError(f"{source}={choice!r} is not one of {KERNEL_CHOICES}")
    return choice


def resolve_kernel(kernel: str | None = None, call: KernelCall | None = None) -> str:
    """The implementation a call with `kernel` uses: 'naive' or 'pallas'.

    Under `auto` on a TPU, with `call`, the Pallas kernel is lowered at the call's shapes first (once per
    `call.signature()`), and a failure means 'naive' (logged once per signature); without `call`, the
    answer is Pallas' before any shape is probed."""
    choice = requested_kernel(kernel)
    if choice == "naive":
        return "naive"
    module, why_not = _pallas_module()
    if choice == "pallas":
        if module is None:
            raise RuntimeError(f"KDA kernel 'pallas' was forced but is unavailable: {why_not}")
        return "pallas"
    if module is None:
        _log_fallback_once(why_not)
        return "naive"
    if not pallas_is_native():
        return "naive"
    failure = "" if call is None else _pallas_probe_failure(call.signature())
    if failure:
        _log_fallback_once(failure)
        return "naive"
    return "pallas"


def execution(implementation: str) -> str:
    """How `implementation` ('naive' or 'pallas') runs on this backend: `naive (xla, cpu)`, compiled by
    XLA; `pallas (mosaic, tpu)`, compiled by Mosaic; `pallas (interpret, cpu)`, Pallas' interpreter
    (anywhere but a TPU)."""
    backend = jax.default_backend()
    if implementation == "naive":
        return f"naive (xla, {backend})"
    return f"pallas ({'mosaic' if pallas_is_native() else 'interpret'}, {backend})"


def kernel_choice(kernel: str | None = None) -> str:
    """How the calls run under `kernel`: `execution(resolve_kernel(kernel))`, and under `auto` the probed
    calls that fell back to plain JAX:
    'pallas (mosaic, tpu), naive (xla, tpu) for chunk_kda(float32[1,16384,32,128], ...)'."""
    resolved = resolve_kernel(kernel)
    if requested_kernel(kernel) != "auto" or resolved != "pallas":
        return execution(resolved)
    fallbacks = [_describe(signature) for signature, failure in _probe_failures.items() if failure]
    if not fallbacks:
        return execution("pallas")
    return f"{execution('pallas')}, {execution('naive')} for {'; '.join(fallbacks)}"


def _implementation(call: KernelCall, kernel: str | None) -> Callable:
    if resolve_kernel(kernel, call) == "pallas":
        module, _ = _pallas_module()
        return getattr(module, call.name)
    return getattr(naive, call.name)


def chunk_kda(q, k, v, g, beta, *, kernel: str | None = None, **kwargs):
    """Chunked KDA (prefill); fla's signature and options, see `kda_impl.kernels.chunk.chunk_kda` and
    `kda_impl.kernels.options` (the Pallas kernel applies `use_gate_in_kernel`'s gate in-kernel, the
    plain-JAX one just before)."""
    call = KernelCall("chunk_kda", (q, k, v, g, beta), kwargs)
    return _implementation(call, kernel)(q, k, v, g, beta, **kwargs)


def fused_recurrent_kda(q, k, v, g, beta, *, kernel: str | None = None, **kwargs):
    """Token-recurrent KDA; fla's signature, see `kda_impl.kernels.recurrent.fused_recurrent_kda`."""
    call = KernelCall("fused_recurrent_kda", (q, k, v, g, beta), kwargs)
    return _implementation(call, kernel)(q, k, v, g, beta, **kwargs)


def decode_kda_slots(q, k, v, g, beta, *, kernel: str | None = None, **kwargs):
    """One decode step per request on its pool slot; see `kda_impl.kernels.decode`."""
    call = KernelCall("decode_kda_slots", (q, k, v, g, beta), kwargs)
    return _implementation(call, kernel)(q, k, v, g, beta, **kwargs)


__all__ = [
    "KERNEL_CHOICES",
    "KERNEL_ENV",
    "KernelCall",
    "chunk_kda",
    "decode_kda_slots",
    "execution",
    "fused_recurrent_kda",
    "kernel_choice",
    "lower_pallas_kernel",
    "pallas_is_native",
    "requested_kernel",
    "resolve_kernel",
]
