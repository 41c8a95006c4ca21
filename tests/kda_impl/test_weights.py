"""Weight loading: HF ↔ transformers names, a dict of HF names, safetensors checkpoints, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import save_file

from dump_gen.references.transformers_names import hf_to_transformers, transformers_to_hf
from kda_impl.weights import layer_from_checkpoint, layer_from_hf_weights
from kda_spec.checkpoint import INDEX_FILE, SINGLE_FILE
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.weight_names import PROJECTIONS, layer_prefix

# Layers 0 and 2 (0-based) are KDA; layer 1 stands for an MLA layer.
CONFIG = get_preset("mini").replace(kda_layers=(1, 3), num_hidden_layers=3)


def prefixed(weights: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    return {layer_prefix(layer) + name: value for name, value in weights.items()}


def write_checkpoint(folder: Path, shards: dict[str, dict[str, np.ndarray]], dtype=jnp.float32) -> None:
    """Safetensors shards (index file when more than one); A_log / dt_bias stay fp32."""
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(
            {
                k: jnp.asarray(v, jnp.float32 if k.endswith(("A_log", "dt_bias")) else dtype)
                for k, v in tensors.items()
            },
            str(folder / shard),
        )
        weight_map.update(dict.fromkeys(tensors, shard))
    if len(shards) > 1:
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_holds(module, weights: dict[str, np.ndarray]) -> None:
    """`module`'s parameters (upcast to float32) are `weights` in JAX layout."""
    heads, dim = CONFIG.num_heads, CONFIG.head_dim

    def check(param, expected: np.ndarray) -> None:
        np.testing.assert_array_equal(np.asarray(param[...], np.float32), expected)

    for name in PROJECTIONS:
        check(getattr(module, name).kernel, weights[f"{name}.weight"].T)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        check(getattr(module, name), weights[f"{name}.weight"][:, 0, :].T)
    check(module.A_log, weights["A_log"].reshape(heads))
    check(module.dt_bias, weights["dt_bias"].reshape(heads, dim))
    check(module.o_norm.weight, weights["o_norm.weight"])


def test_hf_and_transformers_names_round_trip():
    weights = synthetic_weights(CONFIG, seed=0)
    state = hf_to_transformers(weights)
    assert "forget_gate.A_log" in state and "A_log" not in state
    conv = state["conv1d.weight"]
    assert conv.shape == (3 * CONFIG.proj_dim, 1, CONFIG.conv_size)
    np.testing.assert_array_equal(conv[CONFIG.proj_dim : 2 * CONFIG.proj_dim], weights["k_conv1d.weight"])
    back = transformers_to_hf(state)
    assert set(back) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value)
    with pytest.raises(KeyError, match=r"HF weights lack \['o_proj.weight'\]"):
        hf_to_transformers({k: v for k, v in weights.items() if k != "o_proj.weight"})


@pytest.mark.torch
def test_transformers_names_are_its_state_dict(torch_reference):
    state_dict = torch_reference("mini").layer.state_dict()
    mapped = hf_to_transformers(synthetic_weights(get_preset("mini"), seed=0))
    assert {name: tuple(t.shape) for name, t in state_dict.items()} == {n: v.shape for n, v in mapped.items()}


def test_dict_with_or_without_prefix():
    weights, other = synthetic_weights(CONFIG, seed=0), synthetic_weights(CONFIG, seed=1)
    assert_holds(layer_from_hf_weights(CONFIG, 0, weights, jnp.float32), weights)
    everything = {**prefixed(weights, 0), **prefixed(other, 2), "model.embed_tokens.weight": np.zeros(3)}
    assert_holds(layer_from_hf_weights(CONFIG, 2, everything, jnp.float32), other)


def test_bf16_layer_keeps_the_decay_parameters_fp32():
    module = layer_from_hf_weights(CONFIG, 0, synthetic_weights(CONFIG, seed=0), jnp.bfloat16)
    assert module.q_proj.kernel[...].dtype == jnp.bfloat16 and module.o_norm.weight[...].dtype == jnp.bfloat16
    assert module.A_log[...].dtype == jnp.float32 and module.dt_bias[...].dtype == jnp.float32


def test_single_file_checkpoint(tmp_path):
    weights, other = synthetic_weights(CONFIG, seed=0), synthetic_weights(CONFIG, seed=1)
    write_checkpoint(tmp_path, {SINGLE_FILE: {**prefixed(weights, 0), **prefixed(other, 2)}})
    assert_holds(layer_from_checkpoint(CONFIG, tmp_path, 2, jnp.float32), other)


def test_sharded_checkpoint_reads_only_the_shards_of_the_layer(tmp_path):
    weights, other = synthetic_weights(CONFIG, seed=0), synthetic_weights(CONFIG, seed=1)
    names = sorted(weights)
    write_checkpoint(
        tmp_path,
        {
            "model-00001-of-00003.safetensors": prefixed({n: weights[n] for n in names[:7]}, 0),
            "model-00002-of-00003.safetensors": prefixed({n: weights[n] for n in names[7:]}, 0),
            "model-00003-of-00003.safetensors": prefixed(other, 2),
        },
    )
    (tmp_path / "model-00003-of-00003.safetensors").unlink()  # layer 0 never needs it
    assert_holds(layer_from_checkpoint(CONFIG, tmp_path, 0, jnp.float32), weights)
    with pytest.raises(
        FileNotFoundError, match=r"shard .*/model-00003-of-00003\.safetensors \(listed in .*\) does not exist"
    ):
        layer_from_checkpoint(CONFIG, tmp_path, 2, jnp.float32)


def test_bf16_checkpoint(tmp_path):
    weights = synthetic_weights(CONFIG, seed=0)
    write_checkpoint(tmp_path, {SINGLE_FILE: prefixed(weights, 0)}, dtype=jnp.bfloat16)
    module = layer_from_checkpoint(CONFIG, tmp_path, 0, jnp.bfloat16)
    rounded = {k: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for k, v in weights.items()}
    rounded["A_log"], rounded["dt_bias"] = weights["A_log"], weights["dt_bias"]  # stored and kept fp32
    assert_holds(module, rounded)


def test_missing_key_names_the_key_and_the_folder(tmp_path):
    weights = synthetic_weights(CONFIG, seed=0)
    del weights["g_b_proj.weight"]
    write_checkpoint(tmp_path, {SINGLE_FILE: prefixed(weights, 0)})
    with pytest.raises(
        KeyError, match=rf"{tmp_path}/{SINGLE_FILE}: no key 'model.layers.0.self_attn.g_b_proj.weight'"
    ):
        layer_from_checkpoint(CONFIG, tmp_path, 0, jnp.float32)


def test_wrong_shape_names_the_key_and_both_shapes(tmp_path):
    weights = synthetic_weights(CONFIG, seed=0)
    weights["dt_bias"] = np.zeros(CONFIG.proj_dim + 1, np.float32)
    write_checkpoint(tmp_path, {SINGLE_FILE: prefixed(weights, 0)})
    with pytest.raises(
        ValueError, match=r"key 'model.layers.0.self_attn.dt_bias' has shape \[129\], expected \[128\]"
    ):
        layer_from_checkpoint(CONFIG, tmp_path, 0, jnp.float32)


def test_non_kda_layer_is_refused(tmp_path):
    write_checkpoint(tmp_path, {SINGLE_FILE: prefixed(synthetic_weights(CONFIG, seed=0), 0)})
    with pytest.raises(
        ValueError,
        match=r"layer 1 is not a KDA layer of preset 'mini'; its KDA layers \(0-based\) are \[0, 2\]",
    ):
        layer_from_checkpoint(CONFIG, tmp_path, 1, jnp.float32)


def test_layer_absent_from_the_checkpoint(tmp_path):
    write_checkpoint(tmp_path, {SINGLE_FILE: prefixed(synthetic_weights(CONFIG, seed=0), 0)})
    with pytest.raises(KeyError, match=r"no tensor named model.layers.4.self_attn.\*"):
        layer_from_checkpoint(CONFIG.replace(kda_layers=()), tmp_path, 4, jnp.float32)


def test_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"has neither {INDEX_FILE} nor {SINGLE_FILE}"):
        layer_from_checkpoint(CONFIG, tmp_path, 0, jnp.float32)


@pytest.mark.parametrize("shard", ["../model.safetensors", "/tmp/model.safetensors", ["model.safetensors"]])
def test_index_shard_outside_the_folder_or_not_a_name_is_refused(tmp_path, shard):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    names = sorted(synthetic_weights(CONFIG, seed=0))
    weights = synthetic_weights(CONFIG, seed=0)
    write_checkpoint(
        folder,
        {
            "a.safetensors": prefixed({n: weights[n] for n in names[:7]}, 0),
            "b.safetensors": prefixed({n: weights[n] for n in names[7:]}, 0),
        },
    )
    write_checkpoint(tmp_path, {SINGLE_FILE: prefixed(weights, 0)})  # what '..' would reach
    index = json.loads((folder / INDEX_FILE).read_text())
    key = layer_prefix(0) + names[0]
    index["weight_map"][key] = shard
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"key '{key}' names shard") as raised:
        layer_from_checkpoint(CONFIG, folder, 0, jnp.float32)
    assert repr(shard) in str(raised.value)


def test_unknown_weight_in_a_dict():
    weights = {**synthetic_weights(CONFIG, seed=0), "q_proj.bias": np.zeros(CONFIG.proj_dim, np.float32)}
    with pytest.raises(ValueError, match=r"unknown weight\(s\) \['q_proj.bias'\] for layer 0"):
        layer_from_hf_weights(CONFIG, 0, weights, jnp.float32)
