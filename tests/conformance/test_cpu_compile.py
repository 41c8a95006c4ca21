"""`prefer_fast_cpu_compile`: XLA:CPU's loop emitters and LLVM's cheap passes only on a CPU-only machine,
only before JAX starts, never over the caller's own setting of a flag."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from conformance.runtime import cpu_compile
from conformance.runtime.cpu_compile import (
    FAST_CPU_COMPILE_FLAGS,
    cpu_only,
    flag_name,
    prefer_fast_cpu_compile,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def before_jax_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backends of this test process may have started already: pretend they have not."""
    monkeypatch.setattr(cpu_compile, "_backends_started", lambda: False)


@pytest.mark.parametrize(
    ("platforms", "expected"),
    [("cpu", True), (" cpu ", True), ("tpu", False), ("cpu,cuda", False), ("cuda", False)],
)
def test_jax_platforms_decides_when_set(platforms, expected):
    assert cpu_only({"JAX_PLATFORMS": platforms}) is expected


@pytest.mark.parametrize("installed", [True, False])
def test_an_installed_accelerator_plugin_decides_otherwise(monkeypatch, installed):
    monkeypatch.setattr(cpu_compile, "accelerator_plugin_installed", lambda: installed)
    assert cpu_only({}) is not installed


@pytest.mark.usefixtures("before_jax_starts")
def test_the_flags_are_added_after_the_callers_flags():
    devices = "--xla_force_host_platform_device_count=4"
    environ = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": devices}
    assert prefer_fast_cpu_compile(environ)
    assert environ["XLA_FLAGS"].split() == [devices, *FAST_CPU_COMPILE_FLAGS]
    assert prefer_fast_cpu_compile(environ)  # a second call adds nothing
    assert environ["XLA_FLAGS"].split() == [devices, *FAST_CPU_COMPILE_FLAGS]


@pytest.mark.usefixtures("before_jax_starts")
def test_the_callers_own_setting_of_a_flag_wins():
    environ = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"}
    assert not prefer_fast_cpu_compile(environ)  # not every flag as this module sets it
    assert environ["XLA_FLAGS"].split() == [
        "--xla_cpu_use_fusion_emitters=true",
        "--xla_llvm_disable_expensive_passes=true",
    ]


@pytest.mark.usefixtures("before_jax_starts")
def test_nothing_is_added_where_jax_may_use_an_accelerator():
    environ = {"JAX_PLATFORMS": "tpu"}
    assert not prefer_fast_cpu_compile(environ)
    assert "XLA_FLAGS" not in environ


def test_nothing_is_added_once_jax_has_started():
    # The flag could no longer apply in this process, and the compilation cache would file its
    # programs under the flag's name.
    jax.devices()
    environ = {"JAX_PLATFORMS": "cpu"}
    assert not prefer_fast_cpu_compile(environ)
    assert "XLA_FLAGS" not in environ


def test_the_test_session_and_the_cli_compile_with_the_flag_on_a_cpu():
    if not cpu_only():
        pytest.skip("JAX may use an accelerator here: the flag is left out")
    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {flag_name(flag) for flag in FAST_CPU_COMPILE_FLAGS}
    if any(flag_name(flag) in names for flag in flags if flag not in FAST_CPU_COMPILE_FLAGS):
        pytest.skip("$XLA_FLAGS sets one of the flags otherwise: the caller's setting wins")
    assert set(FAST_CPU_COMPILE_FLAGS) <= set(flags)
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    script = textwrap.dedent("""
        import os
        from conformance import cli
        cli.main(["gate", "none.json"])
        print(os.environ["XLA_FLAGS"])
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == list(FAST_CPU_COMPILE_FLAGS)
