"""Every command without an optional dependency: one `error:` line naming the pip install, exit 2, never
a traceback (kda_spec/extras.py). A module is made missing by a None in `sys.modules`, in a process of
its own where the test process may have imported it already."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conformance.cli import main
from kda_spec.extras import EXTRA_OF_MODULE, MissingExtra, missing_extra

REPO = Path(__file__).resolve().parents[2]


def _without(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    script = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from conformance.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's packages, from any folder
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_every_optional_module_names_an_extra_of_the_package() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRA_OF_MODULE.values()) <= set(extras)
    assert str(MissingExtra("diff --png", "matplotlib")) == (
        "diff --png needs matplotlib, which is not installed: pip install 'kda-conformance[png]'"
    )
    assert missing_extra(ModuleNotFoundError("x", name="flax.nnx"), "run").extra == "kda-impl"
    assert missing_extra(ModuleNotFoundError("x", name="my_own_dependency"), "run") is None


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["run", "--cases", "T8", "--dtypes", "fp32", "--report-dir", "r"],
            "error: --impl kda_impl needs flax, which is not installed: "
            "pip install 'kda-conformance[kda-impl]'",
        ),
        (
            ["power", "--cases", "T8", "--dtype", "fp32", "--report-dir", "r"],
            "error: power needs flax, which is not installed: pip install 'kda-conformance[kda-impl]'",
        ),
    ],
    ids=["run", "power"],
)
def test_the_built_in_implementation_without_flax(tmp_path: Path, argv: list[str], line: str) -> None:
    done = _without("flax", argv, tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == line, done.stderr


def test_diff_png_without_matplotlib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["diff", "--case", "T8", "--png", "/tmp/never-written.png"]) == 2
    assert capsys.readouterr().err == (
        "error: diff --png needs matplotlib, which is not installed: pip install 'kda-conformance[png]'\n"
    )
