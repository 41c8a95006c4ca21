"""dump_gen's references compute fp32 in IEEE fp32 (dump_gen/precision.py), and the manifest says what
they ran with: the settings, set before torch is imported, and the `precision` block read back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kda_spec.dump_format import TRITON_F32_DEFAULT
from tests.dump_gen.validate import read_manifest

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def torch_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's TF32 flags all on (as a careless process could have them) and restored after the test."""
    import torch

    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    monkeypatch.delenv(TRITON_F32_DEFAULT, raising=False)
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_use_ieee_fp32_turns_every_tf32_setting_off(torch_flags: None) -> None:
    import os

    import torch

    from dump_gen.precision import precision_block, use_ieee_fp32

    use_ieee_fp32()
    assert os.environ[TRITON_F32_DEFAULT] == "ieee"
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    block = precision_block("cpu")
    assert block == {
        "triton_f32_default": "ieee",
        "torch_matmul_allow_tf32": False,
        "cudnn_allow_tf32": False,
        "float32_matmul_precision": "highest",
        "device": "cpu",
        "device_name": "cpu",
        "compute_capability": None,
        "torch": torch.__version__,
        "triton": block["triton"],  # the installed version, or None without triton
    }


def test_an_explicit_triton_default_is_kept_and_recorded(
    torch_flags: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dump_gen.precision import precision_block, use_ieee_fp32

    monkeypatch.setenv(TRITON_F32_DEFAULT, "tf32")
    use_ieee_fp32()
    assert precision_block("cpu")["triton_f32_default"] == "tf32"


def test_the_command_line_sets_ieee_before_it_imports_torch(tmp_path: Path) -> None:
    """In a fresh process: the variable is set when torch is first imported (`--device cuda` on a CPU
    stops the run just after the import, with exit status 2)."""
    script = textwrap.dedent(
        f"""
        import importlib.abc, json, os, sys
        seen = {{}}
        class Watch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name in ("torch", "triton", "fla"):
                    seen.setdefault(name, os.environ.get("{TRITON_F32_DEFAULT}"))
        sys.meta_path.insert(0, Watch())
        os.environ.pop("{TRITON_F32_DEFAULT}", None)
        from dump_gen.cli import main
        assert not seen, seen
        code = main(["--out", sys.argv[1], "--preset", "mini", "--cases", "T1", "--device", "cuda"])
        print(code, json.dumps(seen))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "set")], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    code, seen = result.stdout.split(" ", 1)
    assert code == "2" and "sees no CUDA device" in result.stderr
    assert json.loads(seen)["torch"] == "ieee", seen


def test_the_manifest_records_the_precision_block(transformers_set: Path) -> None:
    block = read_manifest(str(transformers_set))["precision"]
    assert block["triton_f32_default"] == "ieee" and block["device"] == "cpu"
    assert not block["torch_matmul_allow_tf32"] and not block["cudnn_allow_tf32"]
    assert block["float32_matmul_precision"] == "highest"
