"""An unreachable gs:// endpoint: one line within seconds, from the writer and the reader alike (not
gcsfs's minute of retries behind logged tracebacks). The endpoint is a closed local port, named through
STORAGE_EMULATOR_HOST as gcsfs reads it, so the test does not depend on the machine's network."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kda_spec.remote import LocationError, check_reachable, open_location

pytest.importorskip("gcsfs")

REPO = Path(__file__).parents[2]
TIME_BOUND_S = 20.0


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on leaving: a connect is refused


@pytest.fixture
def unreachable_gcs(closed_port: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{closed_port}")
    return {**os.environ}


def test_open_location_refuses_an_unreachable_endpoint(
    unreachable_gcs: dict[str, str], closed_port: int
) -> None:
    start = time.perf_counter()
    with pytest.raises(LocationError, match=rf"gs://bucket/set: cannot reach 127\.0\.0\.1:{closed_port}"):
        open_location("gs://bucket/set", cached=True)
    assert time.perf_counter() - start < TIME_BOUND_S


def test_check_reachable_returns_on_a_listening_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"http://127.0.0.1:{server.getsockname()[1]}", "gs://bucket/set")


@pytest.mark.parametrize(
    ("command", "prefix"),
    [
        (["-m", "conformance", "verify", "--dumps", "gs://bucket/set"], "error: gs://bucket/set"),
        (["-m", "dump_gen", "--out", "gs://bucket/set", "--preset", "mini"], "dump_gen: error: --out gs://"),
    ],
)
def test_commands_give_one_line_within_the_bound(
    command: list[str], prefix: str, unreachable_gcs: dict[str, str]
) -> None:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, *command], cwd=REPO, env=unreachable_gcs, capture_output=True, text=True, timeout=120
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "cannot reach" in lines[0], result.stderr
    assert elapsed < TIME_BOUND_S, f"{elapsed:.1f} s"
