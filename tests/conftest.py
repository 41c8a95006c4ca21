"""Set-up of the whole test session: XLA:CPU's faster-compiling emitters on a CPU-only machine
(conformance/runtime/cpu_compile.py), set before JAX starts (and, through the environment, in every
process a test starts), and JAX's persistent compilation cache (conformance/runtime/compile_cache.py),
which a `python -m conformance` a test starts turns on for itself."""

from __future__ import annotations

import pytest

from conformance.runtime.compile_cache import enable_compile_cache
from conformance.runtime.cpu_compile import prefer_fast_cpu_compile


def pytest_configure(config: pytest.Config) -> None:
    prefer_fast_cpu_compile()
    enable_compile_cache()
