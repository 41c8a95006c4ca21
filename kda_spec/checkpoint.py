"""One KDA layer's weights read from a safetensors checkpoint folder: the one reader of the project.

A folder holds `model.safetensors.index.json` and the shards it names, or one `model.safetensors`.
Only the requested layer's tensors are read (safetensors' numpy framework: bf16 arrives as
`ml_dtypes.bfloat16`), each checked against the config's shape and returned as float32, bf16 and fp16
upcast exactly, under the family's names (`kda_spec.weight_names`). The index is not trusted: a shard
name must be a string naming a file inside the folder.

Where a checkpoint keeps the layer (`stored_layouts`): under `model.layers.{i}.self_attn.` or, as
transformers' `Glm5NextForConditionalGeneration` (GLM-5.3-Flash) does, `model.language_model.layers.{i}
.self_attn.`; and by the family's names, or by the names transformers 5.24.0 converts a glm5-next
checkpoint from on load (`conversion_mapping.py`, "glm5_next": the gate's weights without `forget_gate.`,
the three convs `{q,k,v}_conv1d.weight` `[P, 1, W]`, which it concatenates into `conv1d.weight`).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np
from safetensors import safe_open

from kda_spec.config import KDAConfig
from kda_spec.families import CANONICAL_CONVS, FUSED_CONV
from kda_spec.weight_names import hf_weight_shapes, layer_prefix

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


class CheckpointError(ValueError):
    """A checkpoint that cannot give the layer asked for; the message names the file, key or shard."""


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """The folder, its index or a shard the index names does not exist."""


class CheckpointKeyMissing(CheckpointError, KeyError):
    """A tensor of the layer is not in the checkpoint."""

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError would quote the message


# The prefix of a multimodal model's text layers (transformers' Glm5NextForConditionalGeneration).
LANGUAGE_MODEL_PREFIX = "model.language_model.layers.{layer}.self_attn."

# One way a checkpoint stores a layer: its key prefix, and for each family weight name the stored names
# it is made of (one; or three convs concatenated on axis 0 into a fused conv).
StoredLayout = tuple[str, dict[str, tuple[str, ...]]]


def stored_layouts(config: KDAConfig, layer_idx: int) -> list[StoredLayout]:
    """Every layout a checkpoint may store layer `layer_idx` of `config`'s family in, the contract's
    (`model.layers.{i}.self_attn.`, the family's names) first."""
    family = config.kda_family
    own = {name: (name,) for name in hf_weight_shapes(config)}
    converted = {family.checkpoint_name(name): (name,) for name in family.renames()}
    if family.conv == FUSED_CONV:
        converted[family.checkpoint_name(CANONICAL_CONVS[0])] = CANONICAL_CONVS
    else:
        converted.update({name: (name,) for name in CANONICAL_CONVS})
    namings = [own] if converted == own else [own, converted]
    prefixes = (layer_prefix(layer_idx), LANGUAGE_MODEL_PREFIX.format(layer=layer_idx))
    return [(prefix, naming) for prefix in prefixes for naming in namings]


def _stored_keys(layout: StoredLayout) -> list[str]:
    prefix, naming = layout
    return [prefix + stored for parts in naming.values() for stored in parts]


def read_checkpoint_layer(folder: str | Path, layer_idx: int, config: KDAConfig) -> dict[str, np.ndarray]:
    """The KDA weights of 0-based layer `layer_idx` by HF name (no prefix), float32, in the order of
    `hf_weight_shapes(config)`, from the first of `stored_layouts` the checkpoint holds whole; a
    CheckpointError naming what is wrong (the missing keys of the layout it holds most of)."""
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointFileMissing(f"checkpoint {folder}: not a directory")
    if layer_idx < 0:
        raise CheckpointError(f"checkpoint layer must be >= 0, got {layer_idx}")
    if config.kda_layers and not config.is_kda_layer(layer_idx):
        kda = [index - 1 for index in config.kda_layers]
        raise CheckpointError(
            f"layer {layer_idx} is not a KDA layer of preset {config.preset!r}; its KDA layers (0-based) "
            f"are {kda}"
        )
    weight_map, where = _weight_map(root)
    layouts = stored_layouts(config, layer_idx)
    missing_by_layout = [[key for key in _stored_keys(layout) if key not in weight_map] for layout in layouts]
    best = min(range(len(layouts)), key=lambda index: len(missing_by_layout[index]))
    (prefix, naming), missing = layouts[best], missing_by_layout[best]
    wanted = _stored_keys(layouts[best])
    if len(missing) == len(wanted):
        raise CheckpointKeyMissing(
            f"{where}: no tensor named {layouts[0][0]}* (is layer {layer_idx} a KDA layer?)"
        )
    if missing:
        raise CheckpointKeyMissing(
            f"{where}: no key {missing[0]!r} "
            f"({len(missing)} of layer {layer_idx}'s {len(wanted)} keys missing)"
        )
    by_shard: dict[str, list[str]] = {}
    for key in wanted:
        by_shard.setdefault(weight_map[key], []).append(key)
    stored: dict[str, np.ndarray] = {}
    for shard, keys in by_shard.items():
        path = root / shard
        if not path.is_file():
            raise CheckpointFileMissing(
                f"checkpoint shard {path} (listed in {where} for {keys[0]!r}) does not exist"
            )
        stored.update(_read_shard(path, keys, where))
    expected = hf_weight_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        parts = [stored[prefix + part] for part in naming[name]]
        key = " | ".join(prefix + part for part in naming[name])
        if len(parts) > 1 and len({part.shape for part in parts}) > 1:
            shapes = [list(part.shape) for part in parts]
            raise CheckpointError(f"checkpoint keys {key} have different shapes {shapes}")
        tensors[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        found = tensors[name].shape
        if found != shape:
            what = f"key {key!r} has" if len(parts) == 1 else f"keys {key} concatenated have"
            raise CheckpointError(
                f"checkpoint {what} shape {list(found)}, expected {list(shape)} for "
                f"hidden_size={config.hidden_size}, num_heads={config.num_heads}, "
                f"head_dim={config.head_dim}, conv_size={config.conv_size}"
            )
    return tensors


def _read_shard(path: Path, keys: list[str], where: Path) -> dict[str, np.ndarray]:
    """`keys` of one shard as float32 arrays; nothing else of the shard is read."""
    try:
        with safe_open(str(path), framework="np") as handle:
            absent = sorted(set(keys) - set(handle.keys()))
            if absent:
                raise CheckpointKeyMissing(
                    f"checkpoint shard {path} lacks {absent[0]!r}, which {where} places there"
                )
            tensors = {key: handle.get_tensor(key) for key in keys}
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise CheckpointError(f"cannot read checkpoint shard {path}: {type(err).__name__}: {err}") from None
    for key, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"checkpoint key {key!r} in {path} has dtype {tensor.dtype}; expected bf16, fp16 or fp32"
            )
    return {key: tensor.astype(np.float32) for key, tensor in tensors.items()}


def _weight_map(root: Path) -> tuple[dict[str, str], Path]:
    """Tensor name → shard file name (checked), and the file that said so."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"checkpoint index {index} is not a safetensors index with a 'weight_map': "
                f"{type(err).__name__}: {err}"
            ) from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"checkpoint index {index}: 'weight_map' must be an object, found {type(weight_map).__name__}"
            )
        for key, shard in weight_map.items():
            _check_shard_name(index, key, shard)
        return weight_map, index
    single = root / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="np") as handle:
                return dict.fromkeys(handle.keys(), SINGLE_FILE), single
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise CheckpointError(f"cannot read checkpoint {single}: {type(err).__name__}: {err}") from None
    raise CheckpointFileMissing(f"checkpoint {root} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _check_shard_name(index: Path, key: str, shard: object) -> None:
    """A shard name must be a relative path that stays inside the checkpoint folder. The check is on the
    name only: a shard that is a symlink (as in the Hugging Face cache) is fine."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(
            f"checkpoint index {index}: key {key!r} names shard {shard!r:.80}, "
            "expected a file name (a string)"
        )
    name = PurePosixPath(shard)
    if name.is_absolute() or ".." in name.parts:
        raise CheckpointError(
            f"checkpoint index {index}: key {key!r} names shard {shard!r}, which is outside the checkpoint "
            "folder (an absolute path or '..'); shard names must be file names inside it"
        )
