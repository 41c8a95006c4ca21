"""The hub layer on a CPU: fla's Triton kernels under the Triton interpreter, fla's naive chunk kernel where
the interpreter cannot run the Triton one.

Triton decides at decoration time, when fla's kernel modules are imported, whether a kernel is compiled
(GPU only) or interpreted (`TRITON_INTERPRET=1`, numpy on the CPU), and the interpreter reads the
variable again while a kernel runs. `triton_interpreter` sets it for the import of the hub files (which
import fla) and `interpreted_run` for each run of the layer, putting the environment back after; a
process where fla's kernels were imported before, compiled, is refused in one line (they would fail at
their first launch: `python -m dump_gen` imports fla only once it knows the device). Under the interpreter
fla's short conv, gated RMSNorm, `fused_kda_gate` and `fused_recurrent_kda` run; its autotuners are
pinned to one config, since benchmarking needs a GPU. fla's Triton `chunk_kda` does not run under the
interpreter (an interpreter error), so the layer's chunk kernel is `dump_gen.kernels.naive_chunk_kda_call`
there. Every substitution is recorded in the manifest's `patches` (`cpu_patches`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
from collections.abc import Iterator
from typing import Any

from dump_gen.errors import DumpError

INTERPRET_VARIABLE = "TRITON_INTERPRET"


def cpu_patches() -> list[str]:
    """The manifest's words for what a CPU run of the hub layer does differently from a GPU run."""
    triton = importlib.metadata.version("triton")
    return [
        f"--device cpu: fla's Triton kernels under the Triton interpreter ({INTERPRET_VARIABLE}=1, "
        f"triton {triton}): ShortConvolution, FusedRMSNormGated, fused_kda_gate and fused_recurrent_kda; "
        "every fla autotuner pinned to its first config (no benchmarking without a GPU)",
        "--device cpu: the layer's chunk_kda (more than 64 tokens) computed by "
        "fla.ops.kda.naive.naive_chunk_kda, one sequence of cu_seqlens at a time, q and k L2-normalised "
        "in fp32 first (fla's Triton chunk_kda fails under the Triton interpreter)",
    ]


def _fla_modules() -> list[Any]:
    return [module for name, module in list(sys.modules.items()) if name == "fla" or name.startswith("fla.")]


@contextlib.contextmanager
def triton_interpreter() -> Iterator[None]:
    """`TRITON_INTERPRET=1` inside the block: Triton kernels imported or run there are interpreted."""
    previous = os.environ.get(INTERPRET_VARIABLE)
    os.environ[INTERPRET_VARIABLE] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[INTERPRET_VARIABLE]
        else:
            os.environ[INTERPRET_VARIABLE] = previous


def _triton_objects(kind: type) -> Iterator[tuple[str, Any]]:
    """Every `kind` among the module-level objects of the imported fla modules and what they wrap."""
    for module in _fla_modules():
        for name, value in list(vars(module).items()):
            seen = 0
            while value is not None and seen < 8:  # Heuristics → Autotuner → kernel chains
                if isinstance(value, kind):
                    yield f"{module.__name__}.{name}", value
                value, seen = getattr(value, "fn", None), seen + 1


def check_interpreted() -> None:
    """A DumpError if any imported fla Triton kernel was made for a GPU instead of interpreted (fla's
    Gluon kernels, a subclass that the interpreter never takes and the hub layer never calls, aside)."""
    from triton.runtime.jit import JITFunction

    compiled = sorted({name for name, kernel in _triton_objects(JITFunction) if type(kernel) is JITFunction})
    if compiled:
        raise DumpError(
            f"--device cpu: {len(compiled)} of fla's Triton kernels (e.g. {compiled[0]}) were imported "
            f"before the Triton interpreter was on; run `python -m dump_gen` in a fresh process, or set "
            f"{INTERPRET_VARIABLE}=1 before anything imports fla"
        )


@contextlib.contextmanager
def autotuners_pinned() -> Iterator[None]:
    """Every imported fla autotuner tries only its first config inside the block."""
    from triton.runtime.autotuner import Autotuner

    tuners = {id(tuner): tuner for _, tuner in _triton_objects(Autotuner)}.values()
    saved = [(tuner, tuner.configs) for tuner in tuners]
    for tuner, configs in saved:
        tuner.configs = configs[:1]
    try:
        yield
    finally:
        for tuner, configs in saved:
            tuner.configs = configs


@contextlib.contextmanager
def interpreted_run() -> Iterator[None]:
    """Inside the block, fla's (interpreted) Triton kernels run on the CPU, each autotuner on one config."""
    check_interpreted()
    with triton_interpreter(), autotuners_pinned():
        yield
