"""Flag errors: one line naming the offending value, exit status 2, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from dump_gen.cli import main
from tests.dump_gen.conftest import dump


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("dump_gen: error: "), err
    return err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--preset", "kimi-huge"], "'kimi-huge'"),
        (["--cases", "T1", "T3"], "'T3'"),
        (["--reference", "vllm"], "'vllm'"),
        (["--device", "tpu"], "'tpu'"),
        (["--checkpoint", "/nowhere"], "--layer"),
        (["--seed", "-1"], "-1"),
        (["--head-dim", "0"], "head_dim"),
        (["--reference", "hf-hub"], "--hub-snapshot"),
    ],
)
def test_bad_flags(flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "set"
    assert main(["--out", str(out), *flags]) == 2
    assert named in error_line(capsys)
    assert not out.exists()


@pytest.mark.torch
def test_unwritable_destination(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert dump(blocker / "set", cases=["T1"]) == 2
    assert f"{blocker / 'set'}: destination is not writable" in error_line(capsys)


@pytest.mark.torch
def test_hub_snapshot_without_the_hub_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dump(tmp_path / "set", "--reference", "hf-hub", "--hub-snapshot", str(tmp_path), cases=["T1"]) == 2
    assert "modeling_kimi.py" in error_line(capsys)
