"""Load one KDA layer's HF weights into a `KimiDeltaAttention`: from a dict, or from a safetensors checkpoint.

HF names are those of `kda_spec.weight_names` (torch layout), with or without the
`model.layers.{i}.self_attn.` prefix. A checkpoint folder holds `model.safetensors.index.json` and its
shards, or one `model.safetensors`; only the tensors of the requested layer are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from kda_impl.models.kimi_linear import PARAM_SPECS, KimiDeltaAttention
from kda_impl.parallel.mesh import put
from kda_spec.config import KDAConfig
from kda_spec.weight_names import FP32_WEIGHTS, hf_weight_shapes, layer_prefix

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# torch layout -> JAX layout, given the target parameter's shape.
Transform = Callable[[np.ndarray, tuple[int, ...]], np.ndarray]


def _transposed(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w.T  # Linear [out, in] -> kernel [in, out]


def _conv_taps(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w[:, 0, :].T  # [P, 1, W] -> [W, P]


def _reshaped(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w.reshape(shape)  # A_log [1, 1, H, 1] -> [H]; dt_bias [P] -> [H, D]; o_norm [D]


# HF name -> (attribute path of the nnx parameter, layout transform).
_PARAM_MAP: dict[str, tuple[tuple[str, ...], Transform]] = {
    "q_proj.weight": (("q_proj", "kernel"), _transposed),
    "k_proj.weight": (("k_proj", "kernel"), _transposed),
    "v_proj.weight": (("v_proj", "kernel"), _transposed),
    "q_conv1d.weight": (("q_conv1d",), _conv_taps),
    "k_conv1d.weight": (("k_conv1d",), _conv_taps),
    "v_conv1d.weight": (("v_conv1d",), _conv_taps),
    "f_a_proj.weight": (("f_a_proj", "kernel"), _transposed),
    "f_b_proj.weight": (("f_b_proj", "kernel"), _transposed),
    "A_log": (("A_log",), _reshaped),
    "dt_bias": (("dt_bias",), _reshaped),
    "b_proj.weight": (("b_proj", "kernel"), _transposed),
    "g_a_proj.weight": (("g_a_proj", "kernel"), _transposed),
    "g_b_proj.weight": (("g_b_proj", "kernel"), _transposed),
    "o_norm.weight": (("o_norm", "weight"), _reshaped),
    "o_proj.weight": (("o_proj", "kernel"), _transposed),
}


def load_layer_weights(
    module: KimiDeltaAttention,
    weights: Mapping[str, np.ndarray],
    source: str = "the weights dict",
) -> None:
    """Copy HF-named weights of layer `module.layer_idx` into `module` (in place), each laid out on the
    module's mesh as `PARAM_SPECS` says (in a multi-process run every process passes the same weights).

    Keys may carry the `model.layers.{i}.self_attn.` prefix: keys of other layers are then ignored.
    Raises KeyError naming a missing key and `source`, ValueError on a wrong shape or an unknown key.
    """
    config = module.config
    layer = _select_layer(weights, module.layer_idx)
    expected = hf_weight_shapes(config)
    unknown = sorted(set(layer) - set(expected))
    if unknown:
        raise ValueError(f"{source}: unknown weight(s) {unknown} for layer {module.layer_idx}")
    for name, shape in expected.items():
        if name not in layer:
            raise KeyError(f"{source}: missing weight {name!r} of layer {module.layer_idx}")
        found = tuple(np.shape(layer[name]))
        if found != shape:
            raise ValueError(f"{source}: weight {name!r} has shape {found}, expected {shape}")
    for name, (path, to_jax) in _PARAM_MAP.items():
        param = module
        for attr in path:
            param = getattr(param, attr)
        dtype = jnp.float32 if name in FP32_WEIGHTS else module.dtype
        value = to_jax(np.asarray(layer[name]), param.shape).astype(dtype)
        param.set_value(put(value, module.mesh, PARAM_SPECS[path]))


def read_checkpoint_layer(
    folder: str | Path, layer_idx: int, config: KDAConfig | None = None
) -> dict[str, np.ndarray]:
    """The tensors `model.layers.{layer_idx}.self_attn.*` of a safetensors checkpoint, keyed by HF name.

    With `config`, refuses a layer that is not a KDA layer of it.
    """
    folder = Path(folder)
    if config is not None and config.kda_layers and not config.is_kda_layer(layer_idx):
        raise ValueError(
            f"layer {layer_idx} is not a KDA layer (1-based kda_layers={config.kda_layers}); "
            "it has no KDA weights"
        )
    prefix = layer_prefix(layer_idx)
    shard_keys = _shard_keys(folder, prefix)
    if not shard_keys:
        raise KeyError(f"{folder}: no tensor named {prefix}* (is layer {layer_idx} a KDA layer?)")
    tensors: dict[str, np.ndarray] = {}
    for shard, keys in shard_keys.items():
        path = folder / shard
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: shard {shard!r} listed in {INDEX_FILE} is missing")
        # framework="flax" reads bf16 tensors (numpy has no bf16 dtype); they come back as ml_dtypes arrays.
        with safe_open(str(path), framework="flax") as f:
            for key in keys:
                tensors[key[len(prefix) :]] = np.asarray(f.get_tensor(key))
    return tensors


def layer_from_hf_weights(
    config: KDAConfig,
    layer_idx: int,
    weights: Mapping[str, np.ndarray],
    dtype: Any = jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "the weights dict",
) -> KimiDeltaAttention:
    """A `KimiDeltaAttention` holding `weights`, built without a random initialisation first."""
    module = nnx.eval_shape(lambda: KimiDeltaAttention(config, layer_idx, mesh, dtype, rngs=nnx.Rngs(0)))
    load_layer_weights(module, weights, source)
    return module


def layer_from_checkpoint(
    config: KDAConfig,
    folder: str | Path,
    layer_idx: int,
    dtype: Any = jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
) -> KimiDeltaAttention:
    """Layer `layer_idx` of the safetensors checkpoint in `folder` as a `KimiDeltaAttention`."""
    weights = read_checkpoint_layer(folder, layer_idx, config)
    return layer_from_hf_weights(config, layer_idx, weights, dtype, mesh, source=str(folder))


def _select_layer(weights: Mapping[str, np.ndarray], layer_idx: int) -> dict[str, np.ndarray]:
    """Weights of one layer keyed by bare HF name: prefixed keys of `layer_idx`, plus unprefixed keys."""
    prefix = layer_prefix(layer_idx)
    layer: dict[str, np.ndarray] = {}
    for key, value in weights.items():
        if key.startswith(prefix):
            layer[key[len(prefix) :]] = value
        elif not key.startswith("model."):
            layer[key] = value
    return layer


def _shard_keys(folder: Path, prefix: str) -> dict[str, list[str]]:
    """{shard file: [keys starting with prefix]} from the index, or from the single safetensors file."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            if key.startswith(prefix):
                shards.setdefault(shard, []).append(key)
        return shards
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="flax") as f:
            keys = f.keys()  # safe_open is not iterable
        layer_keys = [key for key in keys if key.startswith(prefix)]
        return {SINGLE_FILE: layer_keys} if layer_keys else {}
    raise FileNotFoundError(
        f"{folder}: no {INDEX_FILE} or {SINGLE_FILE} (not a safetensors checkpoint folder)"
    )
