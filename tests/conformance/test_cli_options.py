"""What `run` and `diff` pass on: adapter options (`--impl-option`, `--tp/--dp`) and pytest's own options."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conformance.cli import main
from tests.conformance.numpy_adapter import NumpyAdapter

REPO = Path(__file__).resolve().parents[2]
NOISY_IMPL = "tests.conformance.test_cli_options:NoisyNumpyAdapter"
NOISE = "a third party's deprecation noise"


class NoisyNumpyAdapter(NumpyAdapter):
    """The numpy reference, warning on every layer call as some third-party stacks do."""

    name = "noisy numpy-reference"

    def layer_extend(self, *args, **kwargs):
        warnings.warn(NOISE, DeprecationWarning, stacklevel=2)
        return super().layer_extend(*args, **kwargs)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_pytest_options_after_double_dash_reach_pytest(synthetic_dumps: Path, tmp_path: Path) -> None:
    base = ["run", "--dumps", str(synthetic_dumps), "--impl", NOISY_IMPL, "--cases", "T1", "--dtypes", "fp32"]
    base += ["-k", "layer and not state", "--report-dir", str(tmp_path)]
    noisy = _run(*base)
    assert noisy.returncode == 0, noisy.stdout[-2000:] + noisy.stderr[-2000:]
    assert NOISE in noisy.stdout
    quiet = _run(*base, "--", "-W", "ignore::DeprecationWarning")
    assert quiet.returncode == 0, quiet.stdout[-2000:] + quiet.stderr[-2000:]
    assert NOISE not in quiet.stdout and "1 passed" in quiet.stdout


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--impl-option", "speed=1"],
            "error: adapter 'numpy-reference' has no option ['speed']; it accepts: none",
        ),
        (["--impl-option", "speed"], "error: --impl-option 'speed': expected KEY=VALUE"),
        (["--tp", "2"], "error: adapter 'numpy-reference' has no option ['tp']; it accepts: none"),
    ],
)
def test_a_bad_adapter_option_is_one_line_and_exit_2(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture, options: list[str], message: str
) -> None:
    impl = "tests.conformance.numpy_adapter:NumpyAdapter"
    for command in ("run", "diff"):
        case = ["--case", "T8"] if command == "diff" else []
        code = main([command, "--dumps", str(synthetic_dumps), *case, "--impl", impl, *options])
        assert code == 2
        assert capsys.readouterr().err.strip() == message


def test_tp_shorthand_is_the_builtin_adapters_option(
    synthetic_dumps: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["run", "--dumps", str(synthetic_dumps), "--tp", "2", "--impl-option", "tp=4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --tp 2 and --impl-option tp=4: give one"
    assert main(["run", "--dumps", str(synthetic_dumps), "--dp", "x"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: adapter 'kda_impl': option dp='x' must be a positive integer"
    )
    assert main(["run", "--dumps", str(synthetic_dumps), "--tp", "64"]) == 2
    assert "tp=64 x dp=1 needs 64 devices" in capsys.readouterr().err
