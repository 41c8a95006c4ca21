"""The hf-hub reference on a stand-in snapshot with the hub file's import surface and call sites.

The stand-in (`hub_standin/`) imports what the hub's `modeling_kimi.py` imports and calls fla's real
modules and kernels as it does, so the CPU runs here go through the same path as a run of the real file:
the transformers aliases, the Triton interpreter, fla's naive chunk kernel. A CPU run needs a process in
which fla was imported under the interpreter, so those runs are subprocesses of `python -m dump_gen`.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.utils.generic
from fla.ops.kda.gate import naive_kda_gate

from dump_gen.references.hf_hub import RFC_MODELING_MD5, import_snapshot
from dump_gen.references.hub_compat import Alias
from dump_gen.references.hub_patch import old_signature_gate
from tests.dump_gen.conftest import CASES, STANDIN, TINY, dump
from tests.dump_gen.test_generate import case_arrays
from tests.dump_gen.validate import split_key, validate_set

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]
# The names the hub file imports from where transformers no longer has them, and where they are now.
MOVED = {("transformers.utils.generic", "OutputRecorder"): "transformers.utils.output_capturing"}
PROJECT_PACKAGES = ("dump_gen", "kda_spec", "kda_impl", "conformance", "tests")


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    return Path(shutil.copytree(STANDIN, tmp_path / "snapshot"))


def imported_names(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0
        for alias in node.names
    ]


def resolves(module: str, name: str) -> bool:
    owner = importlib.import_module(module)
    if hasattr(owner, name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("file", ["modeling_kimi.py", "configuration_kimi.py"])
def test_every_name_the_standin_imports_resolves_in_the_installed_packages(file: str) -> None:
    """A transformers or fla release that drops or moves a name the hub file imports fails here."""
    names = imported_names(STANDIN / file)
    assert names
    project = [f"{module}.{name}" for module, name in names if module.split(".")[0] in PROJECT_PACKAGES]
    assert not project, f"the stand-in imports code under test: {project}"
    for module, name in names:
        if (module, name) in MOVED:
            assert not resolves(module, name), f"{module}.{name} is back: the alias path is no longer tested"
            assert resolves(MOVED[module, name], name), f"{name} is not in {MOVED[module, name]} either"
        else:
            assert resolves(module, name), f"{file}: `from {module} import {name}` fails"


def test_the_standin_imports_the_moved_names() -> None:
    assert set(MOVED) <= set(imported_names(STANDIN / "modeling_kimi.py"))


def test_import_aliases_moved_names_for_the_import_only(snapshot: Path) -> None:
    from transformers.utils.output_capturing import OutputRecorder

    modeling, configuration, aliases = import_snapshot(str(snapshot))
    assert aliases == [Alias("transformers.utils.generic", "OutputRecorder", *MOVED.values(), "5.2")]
    assert modeling.OutputRecorder is OutputRecorder
    assert configuration.KimiLinearConfig is modeling.KimiLinearConfig
    assert not hasattr(transformers.utils.generic, "OutputRecorder")  # put back as it was
    assert "transformers 5." in aliases[0].note() and "OutputRecorder" in aliases[0].note()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "from transformers.utils.generic import NoSuchHelper",
            "imports NoSuchHelper from transformers.utils.generic: transformers "
            f"{importlib.metadata.version('transformers')} has no such name there",
        ),
        (
            "from fla.no_such_module import ShortConvolution",
            "imports ShortConvolution from fla.no_such_module, which cannot be imported "
            "(ModuleNotFoundError: No module named 'fla.no_such_module') with fla-core",
        ),
    ],
)
def test_an_import_nothing_serves_is_one_line(
    snapshot: Path, line: str, expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    modeling = snapshot / "modeling_kimi.py"
    modeling.write_text(f"{line}\n{modeling.read_text()}")
    assert dump(tmp_path / "out", "--reference", "hf-hub", "--hub-snapshot", str(snapshot)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dump_gen: error: modeling_kimi.py:1 ")
    assert expected in err[0]


def test_unpatched_hub_gate_call_fails_on_the_current_gate(snapshot: Path) -> None:
    """What RFC §6.1.5 fixes: the stand-in's module-level gate is fla's current one, called the 0.4.0 way."""
    modeling, _, _ = import_snapshot(str(snapshot))
    with pytest.raises(TypeError, match="g_bias"):
        modeling.fused_kda_gate(torch.randn(1, 8, 32), torch.zeros(1, 1, 2, 1), 16, g_bias=torch.zeros(32))


def test_old_gate_call_on_the_current_gate() -> None:
    g, a_log, dt_bias = torch.randn(3, 5, 2 * 16), torch.randn(1, 1, 2, 1), torch.randn(2 * 16)
    gate = old_signature_gate(naive_kda_gate)
    expected = naive_kda_gate(g.view(3, 5, 2, 16), a_log, dt_bias=dt_bias)
    torch.testing.assert_close(gate(g, a_log, 16, g_bias=dt_bias), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"beta=0\.5"):
        gate(g, a_log, 16, g_bias=dt_bias, beta=0.5)


def dump_in_subprocess(out: Path, snapshot: Path) -> subprocess.CompletedProcess[str]:
    """`python -m dump_gen` for the tiny hf-hub set on the CPU, in a fresh process (fla not yet imported)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "dump_gen", "--out", str(out), *TINY, "--cases", *CASES]
    command += ["--reference", "hf-hub", "--hub-snapshot", str(snapshot), "--device", "cpu"]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_hub_reference_on_cpu_matches_transformers(
    snapshot: Path, transformers_set: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hub"
    result = dump_in_subprocess(out, snapshot)
    assert result.returncode == 0, result.stderr
    md5 = hashlib.md5((snapshot / "modeling_kimi.py").read_bytes()).hexdigest()
    assert md5 != RFC_MODELING_MD5
    assert f"WARNING: {snapshot / 'modeling_kimi.py'} has md5 {md5}" in result.stderr
    manifest = validate_set(str(out))
    reference = manifest["reference"]
    assert reference["name"] == "hf-hub" and reference["modeling_file_md5"] == md5
    patches = "\n".join(reference["patches"])
    assert "fused_kda_gate(g.unflatten(-1, (-1, head_dim)), A_log, dt_bias=dt_bias)" in patches
    assert "`from transformers.utils.generic import OutputRecorder` served by" in patches
    assert "Triton interpreter (TRITON_INTERPRET=1" in patches
    assert "chunk_kda (more than 64 tokens) computed by fla.ops.kda.naive.naive_chunk_kda" in patches
    # The hub layer runs the packed batch in one call, recurrent at 64 tokens or fewer.
    paths = {case["id"]: case["layer_kernel_path"] for case in manifest["cases"]}
    assert paths == {"T1": "fused_recurrent", "T65": "chunk", "varlen_initstate": "fused_recurrent"}
    for case_id in CASES:
        hub, ours = case_arrays(out, case_id), case_arrays(transformers_set, case_id)
        for key in hub:
            if split_key(key)[1] == "fp32":
                np.testing.assert_allclose(
                    hub[key], ours[key], atol=1e-5, rtol=1e-5, err_msg=f"{case_id} {key}"
                )


def test_a_failure_of_the_hub_layer_is_one_line(snapshot: Path, tmp_path: Path) -> None:
    modeling = snapshot / "modeling_kimi.py"
    modeling.write_text(
        modeling.read_text()
        + textwrap.dedent(
            """
            def _fails(self, *args, **kwargs):
                raise RuntimeError("kernel launch failed\\nsecond line of the message")

            KimiDeltaAttention.forward = _fails
            """
        )
    )
    result = dump_in_subprocess(tmp_path / "out", snapshot)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("dump_gen: error: the hub layer (") and "Traceback" not in result.stderr
    assert last.endswith("RuntimeError: kernel launch failed")


def test_cpu_run_refuses_fla_kernels_compiled_before(
    snapshot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """This process imported fla (above) without the interpreter: its kernels would fail at launch."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("fla was imported under the Triton interpreter in this process")
    assert dump(tmp_path / "out", "--reference", "hf-hub", "--hub-snapshot", str(snapshot)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err.startswith("dump_gen: error: --device cpu: ") and "imported before the Triton interpreter" in err
    )
