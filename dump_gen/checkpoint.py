"""One KDA layer's weights read from a real checkpoint folder (safetensors shards and their index).

Only that layer's fifteen tensors are read; each is checked against the config's shape and returned as
float32 (bf16 checkpoints upcast exactly).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dump_gen.errors import DumpError
from kda_spec.config import KDAConfig
from kda_spec.dump_format import weight_shapes
from kda_spec.weight_names import layer_prefix

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_source(directory: str, layer: int) -> str:
    """The manifest's `weights.source` for this layer of this checkpoint."""
    return f"checkpoint:{directory}@{layer}"


def read_layer(directory: str, layer: int, config: KDAConfig) -> dict[str, np.ndarray]:
    """The KDA weights of 0-based `layer` under their HF names, float32; DumpError naming what is wrong."""
    root = Path(directory)
    if not root.is_dir():
        raise DumpError(f"--checkpoint {directory}: not a directory")
    if layer < 0:
        raise DumpError(f"--layer must be >= 0, got {layer}")
    if config.kda_layers and not config.is_kda_layer(layer):
        kda = [index - 1 for index in config.kda_layers]
        raise DumpError(
            f"--layer {layer} is not a KDA layer of preset {config.preset!r}; its KDA layers are {kda}"
        )
    weight_map = _weight_map(root)
    prefix = layer_prefix(layer)
    expected = weight_shapes(config.to_manifest())
    where = root / INDEX_FILE if (root / INDEX_FILE).exists() else root / SINGLE_FILE
    missing = [prefix + name for name in expected if prefix + name not in weight_map]
    if missing:
        raise DumpError(
            f"checkpoint {where} has no key {missing[0]!r} ({len(missing)} of layer {layer}'s keys missing)"
        )

    by_shard: dict[str, list[str]] = {}
    for name in expected:
        by_shard.setdefault(weight_map[prefix + name], []).append(prefix + name)
    tensors: dict[str, np.ndarray] = {}
    for shard, keys in by_shard.items():
        path = root / shard
        if not path.is_file():
            raise DumpError(f"checkpoint shard {path} (listed in {where} for {keys[0]!r}) does not exist")
        tensors.update(_read_shard(path, keys))
    for name, shape in expected.items():
        got = tensors[prefix + name].shape
        if got != shape:
            raise DumpError(
                f"checkpoint key {prefix + name!r} has shape {list(got)}, expected {list(shape)} for "
                f"hidden_size={config.hidden_size}, num_heads={config.num_heads}, "
                f"head_dim={config.head_dim}, conv_size={config.conv_size}"
            )
    return {name: tensors[prefix + name] for name in expected}


def _read_shard(path: Path, keys: list[str]) -> dict[str, np.ndarray]:
    """`keys` of one safetensors shard as float32 arrays; nothing else of the shard is read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            absent = sorted(set(keys) - set(handle.keys()))
            if absent:
                raise DumpError(f"checkpoint shard {path} lacks {absent[0]!r}, which the index places there")
            return {key: handle.get_tensor(key).float().numpy() for key in keys}
    except DumpError:
        raise
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise DumpError(f"cannot read checkpoint shard {path}: {type(err).__name__}: {err}") from None


def _weight_map(root: Path) -> dict[str, str]:
    """Tensor name → shard file, from the index, or from the single `model.safetensors`."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DumpError(
                f"checkpoint index {index} is not a safetensors index with a 'weight_map': {err}"
            ) from None
        if not isinstance(weight_map, dict):
            raise DumpError(f"checkpoint index {index}: 'weight_map' is not an object")
        return weight_map
    single = root / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as handle:
                return dict.fromkeys(handle.keys(), SINGLE_FILE)
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise DumpError(f"cannot read checkpoint {single}: {type(err).__name__}: {err}") from None
    raise DumpError(f"checkpoint {root} has neither {INDEX_FILE} nor {SINGLE_FILE}")
