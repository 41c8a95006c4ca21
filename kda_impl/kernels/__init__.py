"""The one place that picks a KDA kernel implementation (RFC §4.2).

`naive`  — plain JAX (`kda_impl.kernels.naive`), runs everywhere.
`pallas` — Pallas kernels (`kda_impl.kernels.pallas`), native on TPU; elsewhere they run only in
           interpret mode, which is how they are tested on CPU.
`auto`   — Pallas where it runs natively (TPU), plain JAX elsewhere, and plain JAX whenever the Pallas
           module cannot be imported or lowered (logged once, with the reason).

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
    return "pallas"


def _implementation(name: str, kernel: str | None) -> Callable:
    if resolve_kernel(kernel) == "pallas":
        module, _ = _pallas_module()
        return getattr(module, name)
    return getattr(naive, name)


def chunk_kda(q, k, v, g, beta, *, kernel: str | None = None, **kwargs):
    """Chunked KDA (prefill); fla's signature, see `kda_impl.kernels.naive_chunk.chunk_kda`."""
    return _implementation("chunk_kda", kernel)(q, k, v, g, beta, **kwargs)


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
