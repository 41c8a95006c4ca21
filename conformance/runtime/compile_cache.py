"""JAX's persistent compilation cache, the one place that turns it on for the CLI and the tests.

Compiling dominates a CPU run of the suite and of the tests; with the cache, a second process (the
next `make conform`, or `make conform` after `make test` in one CI run) loads the compiled
executables from disk instead of compiling them again.

Where: `$JAX_COMPILATION_CACHE_DIR` when set (an empty value turns the cache off); otherwise the user's
cache folder, `$XDG_CACHE_HOME/kda-conformance/jax` or `~/.cache/kda-conformance/jax`, whether the package
runs from a checkout or is installed, and from any working directory: every process of one user (the
tests, the CLI, the subprocesses they start) shares it. A cache that cannot be used only costs speed: a
warning, and the run goes on.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# Cache every executable: the tests and the suite compile hundreds of small ones (0.1-1 s each); JAX's
# default (1 s) would keep almost none of them.
MIN_COMPILE_TIME_S = 0.0


class CompileCacheWarning(UserWarning):
    """The persistent compilation cache cannot be used; the run goes on without it."""


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """`kda-conformance/jax` in the user's cache folder: `$XDG_CACHE_HOME`, or `~/.cache` where it is unset,
    empty or relative (the XDG base directory spec ignores a relative one)."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    home = environ.get("HOME") or str(Path.home())
    base = Path(xdg) if os.path.isabs(xdg) else Path(home) / ".cache"
    return base / "kda-conformance" / "jax"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The cache folder to use, or None when `$JAX_COMPILATION_CACHE_DIR` is set empty (cache off)."""
    if CACHE_DIR_ENV in environ:
        value = environ[CACHE_DIR_ENV].strip()
        return Path(value).expanduser().resolve() if value else None  # the same folder in any cwd
    return default_cache_dir(environ)


def _unusable(path: Path) -> str | None:
    """Why `path` cannot hold the cache (it cannot be created or written to), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def enable_compile_cache(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()`; returns the folder, or None when the
    cache is off or unusable (then with a `CompileCacheWarning`, and JAX compiles as without a cache)."""
    import jax

    path = cache_dir(environ)
    problem = None if path is None else _unusable(path)
    if path is None or problem is not None:
        # JAX also reads $JAX_COMPILATION_CACHE_DIR itself, and fails at the first compile when that
        # folder cannot be created: make sure it does not use one.
        jax.config.update("jax_compilation_cache_dir", None)
        if problem is not None:
            warnings.warn(
                f"compilation cache {path} ({CACHE_DIR_ENV}) is not usable, compiling without it: {problem}",
                CompileCacheWarning,
                stacklevel=2,
            )
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return path
