"""On a machine where JAX can only use the CPU, compile with XLA:CPU's loop emitters and LLVM's cheap passes.

XLA:CPU compiles each fusion of a program through MLIR and LLVM, and a CPU run of the tests or of the
suite spends most of its time there (docs/kernels.md, "Speed and compile time"). With
`--xla_cpu_use_fusion_emitters=false` (XLA's older element-wise emitters) the chunk kernel compiles in
~1.0 s instead of ~1.6 s; with `--xla_llvm_disable_expensive_passes=true` as well, a cold golden run's
56 programs compile in 24.6 s instead of 27.3 s. Every number of the golden suite's report is
bit-identical with and without either.

The flags go into `$XLA_FLAGS`, which XLA reads once, when JAX starts its backends:
`prefer_fast_cpu_compile` must run before that (the CLI and the tests call it first), and does
nothing after. It adds them only where JAX has no accelerator to use (`JAX_PLATFORMS=cpu`, or no
TPU or GPU plugin installed), and never over a setting of the same flag already in `$XLA_FLAGS`: set
`--xla_cpu_use_fusion_emitters=true` there to compile as XLA does by default. The flags are in the
persistent compilation cache's key (JAX hashes `$XLA_FLAGS`), so programs compiled with and without
them are never mixed up.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import Mapping, MutableMapping
from importlib.metadata import entry_points

XLA_FLAGS_ENV = "XLA_FLAGS"
FAST_CPU_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_llvm_disable_expensive_passes=true")


def flag_name(flag: str) -> str:
    """`--name` of `--name=value`."""
    return flag.split("=", 1)[0]


def accelerator_plugin_installed() -> bool:
    """Whether JAX could find a TPU (libtpu) or a PJRT plugin (GPU and others) on this machine."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    if entry_points(group="jax_plugins"):
        return True
    if importlib.util.find_spec("jax_plugins") is None:  # the namespace package GPU plugins install into
        return False
    import jax_plugins

    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def cpu_only(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether JAX will run on the CPU alone: `JAX_PLATFORMS` says only cpu, or names nothing and no
    accelerator plugin is installed."""
    platforms = {name.strip() for name in environ.get("JAX_PLATFORMS", "").split(",") if name.strip()}
    if platforms:
        return platforms == {"cpu"}
    return not accelerator_plugin_installed()


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def prefer_fast_cpu_compile(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Add each of `FAST_CPU_COMPILE_FLAGS` that `$XLA_FLAGS` does not set otherwise, on a CPU-only machine
    before JAX starts its backends.

    Returns whether all of them are in `environ` now. Once this process's backends have started it
    changes nothing: the flags could no longer apply here, and the compilation cache would file
    programs compiled without them under their names.
    """
    flags = environ.get(XLA_FLAGS_ENV, "").split()
    named = {flag_name(flag) for flag in flags}
    missing = [flag for flag in FAST_CPU_COMPILE_FLAGS if flag_name(flag) not in named]  # else the caller's
    if missing and cpu_only(environ) and not _backends_started():
        flags += missing
        environ[XLA_FLAGS_ENV] = " ".join(flags)
    return all(flag in flags for flag in FAST_CPU_COMPILE_FLAGS)
