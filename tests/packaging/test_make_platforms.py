"""What each make target would install per platform (`make -n`, nothing run): the platform's extras with
the exact pins of constraints.txt, the gcs extra for a gs:// URL, and a refused unknown platform."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _make_n(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`make -n` of a fresh virtualenv in `tmp_path`: every install step it would run."""
    return subprocess.run(
        ["make", "-n", f"VENV={tmp_path / 'venv'}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _installs(tmp_path: Path, *args: str) -> list[str]:
    done = _make_n(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    return [
        line.split(" -c constraints.txt ", 1)[1]
        for line in done.stdout.splitlines()
        if "pip install" in line and "-c constraints.txt" in line
    ]


@pytest.mark.parametrize(
    ("platform", "jax_extras"), [("cpu", "kda-impl"), ("tpu", "kda-impl,tpu"), ("cuda", "kda-impl,cuda")]
)
def test_conform_installs_the_platforms_jax_extras(tmp_path: Path, platform: str, jax_extras: str) -> None:
    assert _installs(tmp_path, "conform", f"PLATFORM={platform}") == [f"-e '.[{jax_extras}]'"]
    assert _installs(tmp_path, "conform", f"PLATFORM={platform}", "DUMPS=gs://bucket/kda/48b") == [
        f"-e '.[{jax_extras}]'",
        "-e '.[gcs]'",
    ]


def test_dump_on_an_h100_installs_the_gpu_torch_alone_and_runs_on_cuda(tmp_path: Path) -> None:
    done = _make_n(tmp_path, "dump", "PLATFORM=cuda", "OUT=gs://bucket/kda/48b")
    assert _installs(tmp_path, "dump", "PLATFORM=cuda", "OUT=gs://bucket/kda/48b") == [
        "-e '.[torch-gpu]'",
        "-e '.[gcs]'",
    ]
    assert "-m dump_gen --out gs://bucket/kda/48b" in done.stdout and "--device cuda" in done.stdout
    assert _installs(tmp_path, "dump", "PLATFORM=cpu") == ["-e '.[torch-cpu]'"]
    assert "--device cpu" in _make_n(tmp_path, "dump", "PLATFORM=cpu").stdout


def test_test_installs_everything_and_libtpu_for_the_tpu_compile(tmp_path: Path) -> None:
    done = _make_n(tmp_path, "test", "PLATFORM=cpu")
    assert _installs(tmp_path, "test", "PLATFORM=cpu") == [
        "-e '.[kda-impl]'",
        "-e '.[kda-impl,torch-cpu,png,dev]'",
        f"--no-deps --target {tmp_path / 'venv' / 'libtpu'} libtpu",
    ]
    assert f"KDA_LIBTPU_PATH={tmp_path / 'venv' / 'libtpu'} " in done.stdout


def test_an_unknown_platform_is_refused(tmp_path: Path) -> None:
    done = _make_n(tmp_path, "conform", "PLATFORM=gpu")
    assert done.returncode == 2 and "PLATFORM=gpu is not one of cpu tpu cuda" in done.stderr


def test_conform_checks_both_golden_sets_unless_dumps_names_one(tmp_path: Path) -> None:
    runs = [
        line
        for line in _make_n(tmp_path, "conform", "PLATFORM=cpu").stdout.splitlines()
        if "-m conformance" in line
    ]
    assert len(runs) == 2
    glm, golden = sorted(runs, key=lambda line: "glm5-next" not in line)
    assert "--dumps golden --kernel auto --report-dir reports" in golden
    assert "--dumps golden-glm5-next  --kernel auto" in glm  # every case, the serving scenarios too
    assert "--report-dir reports/golden-glm5-next > reports/golden-glm5-next.log 2>&1 &" in glm
    script = _make_n(tmp_path, "conform", "PLATFORM=cpu").stdout
    assert script.index("& glm=$!") < script.index("--dumps golden --kernel") < script.index("wait $glm")
    done = _make_n(tmp_path, "conform", "PLATFORM=cpu", "DUMPS=other", "REPORT_DIR=out")
    runs = [line for line in done.stdout.splitlines() if "-m conformance" in line]
    assert len(runs) == 1 and "--dumps other --kernel auto --report-dir out" in runs[0]
    goldens = _make_n(tmp_path, "goldens", "PLATFORM=cpu").stdout  # one command remakes both sets
    assert "--out golden.tmp --preset mini " in goldens
    assert "--out golden-glm5-next.tmp --preset glm5-next-mini --weights stress" in goldens
