"""Shared fixtures: a small synthetic dump set written by the numpy reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.synthetic import write_dump_set

# Small, but covering one and several sequences, an initial state, and a decode of every token.
SYNTHETIC_CASES = ("T1", "T8", "T65", "varlen_unbalanced_5_17_1_41", "varlen_initstate")


@pytest.fixture(scope="session")
def synthetic_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dump_set(tmp_path_factory.mktemp("synthetic"), SYNTHETIC_CASES)
