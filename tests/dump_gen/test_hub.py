"""The hf-hub reference, on a stand-in snapshot with the hub file's call shapes (the real one needs a GPU)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dump_gen.references.hf_hub import RFC_MODELING_MD5, import_snapshot
from dump_gen.references.hub_patch import old_signature_gate
from tests.dump_gen.conftest import CASES, STANDIN, dump
from tests.dump_gen.test_generate import case_arrays
from tests.dump_gen.validate import split_key, validate_set

pytestmark = pytest.mark.torch


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    shutil.copytree(STANDIN, tmp_path / "snapshot")
    return tmp_path / "snapshot"


def hub_config(modeling) -> object:
    return modeling.KimiLinearConfig(
        hidden_size=32,
        num_hidden_layers=1,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1]},
    )


def test_unpatched_hub_layer_fails_on_the_current_gate(snapshot: Path) -> None:
    """What RFC §6.1.5 fixes: the fla 0.4.0 gate call does not fit fla's current gate."""
    modeling, _ = import_snapshot(str(snapshot))
    layer = modeling.KimiDeltaAttention(hub_config(modeling), layer_idx=0)
    with pytest.raises(TypeError, match="g_bias"):
        layer(torch.randn(1, 8, 32))


def test_old_gate_call_on_the_current_gate() -> None:
    from fla.ops.kda.gate import naive_kda_gate

    g, a_log, dt_bias = torch.randn(3, 5, 2 * 16), torch.randn(1, 1, 2, 1), torch.randn(2 * 16)
    gate = old_signature_gate(naive_kda_gate)
    expected = naive_kda_gate(g.view(3, 5, 2, 16), a_log, dt_bias=dt_bias)
    torch.testing.assert_close(gate(g, a_log, 16, g_bias=dt_bias), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"beta=0\.5"):
        gate(g, a_log, 16, g_bias=dt_bias, beta=0.5)


def test_hub_reference_matches_transformers(
    snapshot: Path, transformers_set: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hub"
    assert dump(out, "--reference", "hf-hub", "--hub-snapshot", str(snapshot)) == 0
    md5 = hashlib.md5((snapshot / "modeling_kimi.py").read_bytes()).hexdigest()
    assert md5 != RFC_MODELING_MD5
    assert f"WARNING: {snapshot / 'modeling_kimi.py'} has md5 {md5}" in capsys.readouterr().err
    manifest = validate_set(str(out))
    reference = manifest["reference"]
    assert reference["name"] == "hf-hub" and reference["modeling_file_md5"] == md5
    assert any("fused_kda_gate" in patch for patch in reference["patches"])
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
