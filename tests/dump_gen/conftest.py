"""Small dump sets shared by the dump_gen tests: a tiny layer (hidden 32, 2 heads of 16) and three cases
that cover a chunk boundary (T65), a packed batch with initial states and a one-token sequence
(varlen_initstate), and the shortest case (T1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dump_gen.cli import main

TINY = ["--preset", "mini", "--hidden-size", "32", "--head-dim", "16", "--no-progress"]
CASES = ["T1", "T65", "varlen_initstate"]
STANDIN = Path(__file__).parent / "hub_standin"


def dump(out: str | Path, *extra: str, cases: list[str] = CASES) -> int:
    """Run the command line into `out` with the tiny config; returns its exit status."""
    return main(["--out", str(out), *TINY, "--cases", *cases, *extra])


@pytest.fixture(scope="session")
def transformers_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("transformers")
    assert dump(out, "--reference", "transformers") == 0
    return out


@pytest.fixture(scope="session")
def fla_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fla")
    assert dump(out, "--reference", "fla") == 0
    return out
