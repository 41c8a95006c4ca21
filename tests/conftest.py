"""Set-up of the whole test session, in this process and, through the environment, in every process a
test starts: XLA:CPU's faster-compiling emitters on a CPU-only machine (conformance/runtime/cpu_compile.py),
set before JAX starts, and JAX's persistent compilation cache (conformance/runtime/compile_cache.py)."""

from __future__ import annotations

import os

import pytest

from conformance.runtime.compile_cache import enable_compile_cache, subprocess_environ
from conformance.runtime.cpu_compile import prefer_fast_cpu_compile


def pytest_configure(config: pytest.Config) -> None:
    prefer_fast_cpu_compile()
    os.environ.update(subprocess_environ(enable_compile_cache()))
