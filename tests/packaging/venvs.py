"""Fresh virtualenvs holding sgl-jax's pins of the JAX stack, for the packaging tests: the environment
of an implementation under test, into which the package must install without changing a pin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SGL_JAX_PINS = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.4"}
PIP_TIMEOUT_S = 600


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pip ARGS`, asserted to succeed (the end of its output in the message)."""
    done = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def fresh_venv(folder: Path) -> Path:
    """A new virtualenv in `folder`; its python."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=120)
    return folder / "bin" / "python"


def pin_args() -> list[str]:
    """`jax==0.10.2 jaxlib==0.10.2 flax==0.12.4`, as pip takes them."""
    return [f"{name}=={version}" for name, version in SGL_JAX_PINS.items()]
