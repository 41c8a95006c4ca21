"""JAX's persistent compilation cache: where it lives, that a second process hits it, and that a cache
which cannot be used never fails a run."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

from conformance.runtime.compile_cache import (
    CACHE_DIR_ENV,
    cache_dir,
    default_cache_dir,
    enable_compile_cache,
)

REPO = Path(__file__).resolve().parents[2]
# Compiles one function and prints how many executables came from the persistent cache.
COMPILE_ONE = """
import jax, jax.numpy as jnp
from jax import monitoring
from conformance.runtime.compile_cache import enable_compile_cache
hits = []
monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
print("cache", enable_compile_cache())
print("value", float(jax.jit(lambda x: jnp.cumsum(jnp.sin(x)).sum())(jnp.arange(37.0))))
print("hits", len(hits))
"""


def _compile_one(cache: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), CACHE_DIR_ENV: cache}
    return subprocess.run(
        [sys.executable, "-c", COMPILE_ONE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def _lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


def test_the_folder_comes_from_the_environment_else_the_users_cache_folder() -> None:
    assert cache_dir({CACHE_DIR_ENV: "/somewhere/jax"}) == Path("/somewhere/jax")
    assert cache_dir({CACHE_DIR_ENV: " "}) is None  # set empty: the cache is off
    xdg = {"XDG_CACHE_HOME": "/xdg", "HOME": "/home/u"}
    assert cache_dir(xdg) == default_cache_dir(xdg) == Path("/xdg/kda-conformance/jax")
    home_cache = Path("/home/u/.cache/kda-conformance/jax")
    # Unset, empty or relative (ignored, as the XDG base directory spec says: never a folder of the cwd).
    for xdg_value in ({}, {"XDG_CACHE_HOME": ""}, {"XDG_CACHE_HOME": ".cache"}):
        assert cache_dir({**xdg_value, "HOME": "/home/u"}) == home_cache


def test_processes_in_any_folder_share_the_default_cache(tmp_path: Path) -> None:
    # `make test` and `make conform` (and the subprocesses of the tests) run in different folders with
    # the same environment: they must name the same cache.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}
    script = "from conformance.runtime.compile_cache import cache_dir; print(cache_dir())"
    folders = []
    for cwd in (REPO, tmp_path):
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr[-3000:]
        folders.append(done.stdout.strip())
    assert folders == [str(tmp_path / "home" / ".cache" / "kda-conformance" / "jax")] * 2


def test_a_second_process_loads_the_executable_from_the_cache(tmp_path: Path) -> None:
    first = _lines(_compile_one(str(tmp_path)))
    assert first["cache"] == str(tmp_path) and first["hits"] == "0"
    entries = list(tmp_path.glob("*-cache"))
    assert entries, "the first process wrote no cache entry"
    second = _lines(_compile_one(str(tmp_path)))
    assert second["hits"] == str(len(entries)) and second["value"] == first["value"]


def test_an_unusable_cache_only_warns_and_the_run_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = _compile_one(str(blocker / "jax"))
    lines = _lines(result)
    assert lines["cache"] == "None" and lines["hits"] == "0" and float(lines["value"]) != 0
    assert f"compilation cache {blocker / 'jax'} ({CACHE_DIR_ENV}) is not usable" in result.stderr


def test_an_empty_variable_turns_the_cache_off_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    updates: dict[str, object] = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert enable_compile_cache({CACHE_DIR_ENV: ""}) is None
    assert updates == {"jax_compilation_cache_dir": None}  # also when JAX read the variable itself
