"""The one place that picks a KDA kernel implementation (RFC §4.2).

`naive`  — plain JAX (`kda_impl.kernels.naive`), runs everywhere.
`pallas` — Pallas kernels (`kda_impl.kernels.pallas`), native on TPU; elsewhere they run only in
           interpret mode, which is how they are tested on CPU.
`auto`   — Pallas where it runs natively (TPU), plain JAX elsewhere, and plain JAX whenever the Pallas
           module cannot be imported, or a small probe of each kernel fails to lower on this backend
           (logged once, with the reason).

Choose with the `kernel=` argument of each function or the `KDA_KERNEL` environment variable
(`naive|pallas|auto`, default `auto`). `resolve_kernel()` says which implementation a call would use.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp

from kda_impl.kernels import naive
from kda_impl.kernels.common import kda_gate
from kda_impl.kernels.validation import validate_float_inputs

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


@functools.cache
def _pallas_lowering_failure() -> str:
    """Lower a tiny instance of each Pallas kernel for this backend once; "" or why it failed."""
    module, why_not = _pallas_module()
    if module is None:
        return why_not
    heads, dim, tokens = 1, 128, 16
    f32 = jnp.float32
    token_args = [jax.ShapeDtypeStruct((1, tokens, heads, dim), f32)] * 4
    beta = jax.ShapeDtypeStruct((1, tokens, heads), f32)
    step_args = [jax.ShapeDtypeStruct((2, heads, dim), f32)] * 4 + [jax.ShapeDtypeStruct((2, heads), f32)]
    probes = {
        "chunk_kda": (module.chunk_kda, (*token_args, beta), {}),
        "fused_recurrent_kda": (module.fused_recurrent_kda, (*token_args, beta), {}),
        "decode_kda_slots": (
            module.decode_kda_slots,
            step_args,
            {
                "state_buffer": jnp.zeros((3, heads, dim, dim), f32),
                "slot_indices": jnp.arange(2, dtype=jnp.int32),
            },
        ),
    }
    for name, (kernel, args, kwargs) in probes.items():
        try:
            jax.jit(functools.partial(kernel, **kwargs)).lower(*args)
        except Exception as err:  # any lowering error means: do not use Pallas here
            return f"{name} does not lower on {jax.default_backend()}: {type(err).__name__}: {err}"
    return ""


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


def resolve_kernel(kernel: str | None = None) -> str:
    """The implementation a call with `kernel` uses: 'naive' or 'pallas'."""
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
    if jax.default_backend() != "tpu":
        return "naive"
    failure = _pallas_lowering_failure()
    if failure:
        _log_fallback_once(failure)
        return "naive"
    return "pallas"


def _implementation(name: str, kernel: str | None) -> Callable:
    if resolve_kernel(kernel) == "pallas":
        module, _ = _pallas_module()
        return getattr(module, name)
    return getattr(naive, name)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    kernel: str | None = None,
    use_gate_in_kernel: bool = False,
    A_log=None,
    dt_bias=None,
    **kwargs,
):
    """Chunked KDA (prefill); fla's signature, see `kda_impl.kernels.chunk.chunk_kda`.

    With `use_gate_in_kernel`, `g` is the raw gate projection `[B, T, H, K]` and the decay
    `-exp(A_log[h]) * softplus(g + dt_bias)` (A_log `[H]`, dt_bias `[H, K]` or `[H * K]`) is computed
    inside the Pallas kernel, or just before the plain-JAX one.
    """
    if resolve_kernel(kernel) == "pallas":
        module, _ = _pallas_module()
        gate = {"use_gate_in_kernel": use_gate_in_kernel, "A_log": A_log, "dt_bias": dt_bias}
        return module.chunk_kda(q, k, v, g, beta, **gate, **kwargs)
    if use_gate_in_kernel:
        validate_float_inputs(g=g)  # as the Pallas kernel does, before the gate upcasts it
        heads, key_dim = g.shape[2], g.shape[3]
        if A_log is None or jnp.shape(A_log) != (heads,):
            raise ValueError(
                f"use_gate_in_kernel=True needs A_log of shape [H]=({heads},), got {A_log!r:.80}"
            )
        bias = jnp.zeros((heads, key_dim)) if dt_bias is None else jnp.reshape(dt_bias, (heads, key_dim))
        g = kda_gate(g, jnp.asarray(A_log)[:, None], bias)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True")
    return naive.chunk_kda(q, k, v, g, beta, **kwargs)


def fused_recurrent_kda(q, k, v, g, beta, *, kernel: str | None = None, **kwargs):
    """Token-recurrent KDA; fla's signature, see `kda_impl.kernels.naive_recurrent.fused_recurrent_kda`."""
    return _implementation("fused_recurrent_kda", kernel)(q, k, v, g, beta, **kwargs)


def decode_kda_slots(q, k, v, g, beta, *, kernel: str | None = None, **kwargs):
    """One decode step per request on its pool slot; see `kda_impl.kernels.naive_decode`."""
    return _implementation("decode_kda_slots", kernel)(q, k, v, g, beta, **kwargs)


__all__ = [
    "KERNEL_CHOICES",
    "KERNEL_ENV",
    "chunk_kda",
    "decode_kda_slots",
    "fused_recurrent_kda",
    "requested_kernel",
    "resolve_kernel",
]
