"""Weights of one layer read from safetensors shards and their index, and clear errors for a bad folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import kda_spec.synthetic_weights
from dump_gen.checkpoint import read_layer
from dump_gen.errors import DumpError
from kda_spec.checkpoint import INDEX_FILE
from kda_spec.config import get_preset
from kda_spec.dump_format import weight_shapes
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.weight_names import layer_prefix
from tests.dump_gen.conftest import dump
from tests.dump_gen.validate import read_npz, validate_set

pytestmark = pytest.mark.torch

CONFIG = get_preset("mini").replace(hidden_size=32, head_dim=16, preset="custom")
LAYER = 0


def write_checkpoint(root: Path, weights: dict[str, np.ndarray]) -> dict[str, str]:
    """Two shards: this layer's tensors split across them (bf16 projections, fp32 A_log and dt_bias),
    plus another layer's tensor that must not matter. Returns the index's weight map."""
    prefix = layer_prefix(LAYER)
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}}
    shards["model-00002-of-00002.safetensors"] = {"model.layers.0.mlp.w1.weight": torch.ones(4, 4)}
    for index, (name, array) in enumerate(weights.items()):
        tensor = torch.from_numpy(array)
        if name.endswith("proj.weight"):
            tensor = tensor.to(torch.bfloat16)
        shards[f"model-0000{index % 2 + 1}-of-00002.safetensors"][prefix + name] = tensor
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(root / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    weights = synthetic_weights(CONFIG, seed=7)
    write_checkpoint(tmp_path, weights)
    return tmp_path, weights


def expected_values(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the checkpoint holds: the projections rounded to bf16."""
    return {
        name: torch.from_numpy(array).bfloat16().float().numpy() if name.endswith("proj.weight") else array
        for name, array in weights.items()
    }


def test_reads_the_layer(checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, weights = checkpoint
    read = read_layer(str(root), LAYER, CONFIG)
    assert list(read) == list(weight_shapes(CONFIG.to_manifest()))
    for name, array in expected_values(weights).items():
        assert read[name].dtype == np.float32
        np.testing.assert_array_equal(read[name], array, err_msg=name)


def test_missing_shard(checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = checkpoint
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DumpError, match=r"model-00002-of-00002\.safetensors.*does not exist"):
        read_layer(str(root), LAYER, CONFIG)


def test_missing_key(checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = checkpoint
    index = json.loads((root / INDEX_FILE).read_text())
    del index["weight_map"][layer_prefix(LAYER) + "dt_bias"]
    (root / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DumpError, match=r"no key 'model\.layers\.0\.self_attn\.dt_bias'"):
        read_layer(str(root), LAYER, CONFIG)


def test_key_the_index_misplaces(checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = checkpoint
    index = json.loads((root / INDEX_FILE).read_text())
    key = layer_prefix(LAYER) + "A_log"
    index["weight_map"][key] = next(
        shard for shard in set(index["weight_map"].values()) if shard != index["weight_map"][key]
    )
    (root / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DumpError, match=r"lacks 'model\.layers\.0\.self_attn\.A_log'"):
        read_layer(str(root), LAYER, CONFIG)


def test_wrong_shape(checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = checkpoint
    with pytest.raises(
        DumpError,
        match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' has shape \[32, 32\], expected \[32, 64\]",
    ):
        read_layer(str(root), LAYER, CONFIG.replace(hidden_size=64))


@pytest.mark.parametrize(
    ("shard", "complaint"),
    [
        ("/etc/passwd", "outside the checkpoint folder"),
        ("../elsewhere.safetensors", "outside the checkpoint folder"),
        ("sub/../../x.safetensors", "outside the checkpoint folder"),
        (7, "expected a file name"),
        (None, "expected a file name"),
    ],
)
def test_index_shard_names_stay_in_the_folder(
    shard: object, complaint: str, checkpoint: tuple[Path, dict[str, np.ndarray]]
) -> None:
    root, _ = checkpoint
    index = json.loads((root / INDEX_FILE).read_text())
    key = layer_prefix(LAYER) + "o_proj.weight"
    index["weight_map"][key] = shard
    (root / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(DumpError, match=complaint) as raised:
        read_layer(str(root), LAYER, CONFIG)
    assert f"key {key!r} names shard {shard!r}" in str(raised.value) and "\n" not in str(raised.value)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(DumpError, match=r"neither model\.safetensors\.index\.json nor model\.safetensors"):
        read_layer(str(tmp_path), LAYER, CONFIG)


def test_not_a_kda_layer(checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = checkpoint
    with pytest.raises(DumpError, match=r"layer 3 is not a KDA layer of preset 'kimi-linear-48b-a3b'"):
        read_layer(str(root), 3, get_preset("kimi-linear-48b-a3b"))


def test_cli_writes_the_checkpoint_weights(
    checkpoint: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, weights = checkpoint
    out = tmp_path / "set"
    assert dump(out, "--checkpoint", str(root), "--layer", str(LAYER), cases=["T1"]) == 0
    manifest = validate_set(str(out))
    assert manifest["weights"]["source"] == f"checkpoint:{root}@{LAYER}"
    stored = read_npz(str(out), "weights.npz", manifest["weights"]["sha256"])
    for name, array in expected_values(weights).items():
        np.testing.assert_array_equal(stored[name], array, err_msg=name)
    (root / "model-00001-of-00002.safetensors").unlink()
    assert dump(tmp_path / "other", "--checkpoint", str(root), "--layer", str(LAYER), cases=["T1"]) == 2
    assert "model-00001-of-00002.safetensors" in capsys.readouterr().err


def test_all_nan_checkpoint_layer_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = {name: np.full_like(array, np.nan) for name, array in synthetic_weights(CONFIG, seed=7).items()}
    write_checkpoint(tmp_path, weights)
    out = tmp_path / "set"
    assert dump(out, "--checkpoint", str(tmp_path), "--layer", str(LAYER), cases=["T1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the libraries' own warnings
    assert err.startswith("dump_gen: error: weight 'q_proj.weight'"), err
    assert "holds NaN or Inf" in err
    assert not out.exists() and not list(tmp_path.glob(".set.staging-*"))


def test_reference_overflowing_to_inf_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Finite weights whose output overflows float32: the first non-finite result is named."""
    real_synthetic_weights = kda_spec.synthetic_weights.synthetic_weights

    def huge_output_projection(config, seed):
        weights = real_synthetic_weights(config, seed)
        weights["o_norm.weight"] = weights["o_norm.weight"] * np.float32(1e30)
        weights["o_proj.weight"] = weights["o_proj.weight"] * np.float32(1e30)
        return weights

    monkeypatch.setitem(kda_spec.synthetic_weights.WEIGHTS_KINDS, "synthetic", huge_output_projection)
    out = tmp_path / "set"
    assert dump(out, cases=["T1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the libraries' own warnings
    assert err.startswith("dump_gen: error: case T1: reference result 'out_fp32' holds NaN or Inf"), err
    assert not out.exists() and not list(tmp_path.glob(".set.staging-*"))
