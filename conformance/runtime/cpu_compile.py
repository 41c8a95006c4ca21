"""On a machine where JAX can only use the CPU, compile with XLA:CPU's loop emitters.

XLA:CPU compiles each fusion of a program through MLIR and LLVM, and a CPU run of the tests or of the
suite spends most of its time there (docs/kernels.md, "Speed and compile time"). With
`--xla_cpu_use_fusion_emitters=false` (XLA's older element-wise emitters) the chunk kernel compiles in
~1.0 s instead of ~1.6 s, and every number of the golden suite's report is bit-identical.

The flag goes into `$XLA_FLAGS`, which XLA reads once, when JAX starts its backends:
`prefer_fast_cpu_compile` must run before that (the CLI and the tests call it first), and does
nothing after. It adds the flag only where JAX has no accelerator to use (`JAX_PLATFORMS=cpu`, or no
TPU or GPU plugin installed), and never over a setting of the same flag already in `$XLA_FLAGS`: set
`--xla_cpu_use_fusion_emitters=true` there to compile as XLA does by default. The flag is in the
persistent compilation cache's key (JAX hashes `$XLA_FLAGS`), so programs compiled with and without
it are never mixed up.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import Mapping, MutableMapping
from importlib.metadata import entry_points

XLA_FLAGS_ENV = "XLA_FLAGS"
FLAG_NAME = "--xla_cpu_use_fusion_emitters"
FAST_CPU_COMPILE_FLAG = f"{FLAG_NAME}=false"


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
    """Add `FAST_CPU_COMPILE_FLAG` to `$XLA_FLAGS` on a CPU-only machine before JAX starts its backends.

    Returns whether the flag is in `environ` now. Once this process's backends have started it changes
    nothing: the flag could no longer apply here, and the compilation cache would file programs
    compiled without it under its name.
    """
    flags = environ.get(XLA_FLAGS_ENV, "")
    if FLAG_NAME in flags:  # set by the caller, either way
        return FAST_CPU_COMPILE_FLAG in flags.split()
    if not cpu_only(environ) or _backends_started():
        return False
    environ[XLA_FLAGS_ENV] = f"{flags} {FAST_CPU_COMPILE_FLAG}".strip()
    return True
