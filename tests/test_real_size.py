"""The long real-size runs, `make test-slow` (marked `slow`: never in `make test`): what `make conform-full`
does, as tests. The twelve cases of the kimi-linear-48b-a3b preset, generated on the fly by transformers'
layer on this CPU, then the conformance suite of kda_impl on them at TP=1 and TP=4, each run held to exit 0
with every planned check run and none failed (about 8 minutes on a 2-core CPU: 1.5 + 3 + 3.5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[1]
PRESET = "kimi-linear-48b-a3b"
# Far above an honest run's time on a busy 2-core CPU; a run past it fails with what it printed.
COMMAND_TIMEOUT_S = 3600


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m ARGS` in the checkout, failing the test with its output unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{' '.join(args)}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="module")
def real_size_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The preset's twelve cases, as `make conform-full` generates them (transformers' layer, CPU)."""
    out = tmp_path_factory.mktemp("dumps") / PRESET
    _run("dump_gen", "--out", str(out), "--preset", PRESET, "--reference", "transformers", "--device", "cpu")
    return out


@pytest.mark.parametrize("tp", [1, 4], ids=lambda tp: f"tp{tp}")
def test_kda_impl_conforms_at_the_real_size(real_size_dumps: Path, tmp_path: Path, tp: int) -> None:
    env = dict(os.environ)
    if tp > 1:  # CPU devices for the mesh, as `make conform-full` makes them
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    _run(
        "conformance",
        "run",
        "--dumps",
        str(real_size_dumps),
        "--tp",
        str(tp),
        "--report-dir",
        str(tmp_path),
        env=env,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["completion"]["complete"], report["completion"]
    assert report["dumps"]["manifest"]["config"]["preset"] == PRESET
    assert str(report["implementation"]["options"]["tp"]) == str(tp)
    cases = {case["id"] for case in report["dumps"]["manifest"]["cases"]}
    assert len(cases) == 12 and cases <= {check["case"] for check in report["checks"]}
    summary = report["summary"]
    assert summary["failed"] == summary["error"] == 0 and summary["passed"] > summary["skipped"], summary
