"""Set-up of the whole test session: JAX's persistent compilation cache (conformance/compile_cache.py), in
this process and, through the environment, in every process a test starts."""

from __future__ import annotations

import os

import pytest

from conformance.compile_cache import enable_compile_cache, subprocess_environ


def pytest_configure(config: pytest.Config) -> None:
    os.environ.update(subprocess_environ(enable_compile_cache()))
