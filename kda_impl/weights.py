"""Load one KDA layer's HF weights into a `KimiDeltaAttention`: from a dict, or from a safetensors checkpoint.

HF names are those of `kda_spec.weight_names` (torch layout), with or without the
`model.layers.{i}.self_attn.` prefix. Checkpoints are read by `kda_spec.checkpoint` (the project's one
safetensors reader): only the tensors of the requested layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kda_impl.models.kimi_linear import PARAM_SPECS, KimiDeltaAttention
from kda_impl.parallel.mesh import put
from kda_spec.checkpoint import read_checkpoint_layer
from kda_spec.config import KDAConfig
from kda_spec.families import (
    CANONICAL_CONVS,
    FUSED_CONV,
    canonical_weight_shapes,
    canonical_weights,
    family_weights,
)
from kda_spec.weight_names import hf_weight_shapes, layer_prefix

# torch layout -> JAX layout (then reshaped to the parameter's shape).
Transform = Callable[[np.ndarray], np.ndarray]


def _transposed(w: np.ndarray) -> np.ndarray:
    return w.T  # Linear [out, in] -> kernel [in, out]


def _conv_taps(w: np.ndarray) -> np.ndarray:
    return w[:, 0, :].T  # [P, 1, W] -> [W, P]


def _unchanged(w: np.ndarray) -> np.ndarray:
    return w  # A_log [1, 1, H, 1] -> [H]; dt_bias [P] -> [H, D]; o_norm [D]: by the parameter's shape


# Canonical HF name (kda_spec.families) -> (attribute path of the nnx parameter, layout transform).
_PARAM_MAP: dict[str, tuple[tuple[str, ...], Transform]] = {
    "q_proj.weight": (("q_proj", "kernel"), _transposed),
    "k_proj.weight": (("k_proj", "kernel"), _transposed),
    "v_proj.weight": (("v_proj", "kernel"), _transposed),
    "q_conv1d.weight": (("q_conv1d",), _conv_taps),
    "k_conv1d.weight": (("k_conv1d",), _conv_taps),
    "v_conv1d.weight": (("v_conv1d",), _conv_taps),
    "f_a_proj.weight": (("f_a_proj", "kernel"), _transposed),
    "f_b_proj.weight": (("f_b_proj", "kernel"), _transposed),
    "A_log": (("A_log",), _unchanged),
    "dt_bias": (("dt_bias",), _unchanged),
    "b_proj.weight": (("b_proj", "kernel"), _transposed),
    "g_a_proj.weight": (("g_a_proj", "kernel"), _transposed),
    "g_b_proj.weight": (("g_b_proj", "kernel"), _transposed),
    "o_norm.weight": (("o_norm", "weight"), _unchanged),
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
    canonical = canonical_weights(config, layer)
    for path, value, kept_fp32 in _parameter_values(config, canonical):
        param = module
        for attr in path:
            param = getattr(param, attr)
        dtype = jnp.float32 if kept_fp32 else module.dtype
        param.set_value(put(value.reshape(param.shape).astype(dtype), module.mesh, PARAM_SPECS[path]))


def _parameter_values(
    config: KDAConfig, canonical: Mapping[str, np.ndarray]
) -> list[tuple[tuple[str, ...], np.ndarray, bool]]:
    """(parameter path, value in JAX layout, kept fp32) of every parameter, from canonical weights: a
    fused family's three canonical convs go into its one `conv1d` `[W, 3, P]`."""
    kept = config.kda_family.fp32_canonical
    fused = config.kda_family.conv == FUSED_CONV
    values = [
        (path, to_jax(np.asarray(canonical[name])), name in kept)
        for name, (path, to_jax) in _PARAM_MAP.items()
        if not (fused and name in CANONICAL_CONVS)
    ]
    if fused:
        taps = np.stack([_conv_taps(np.asarray(canonical[name])) for name in CANONICAL_CONVS], axis=1)
        values.append((("conv1d",), taps, CANONICAL_CONVS[0] in kept))
    return values


def hf_weights_of(config: KDAConfig, params: nnx.State) -> dict[str, np.ndarray]:
    """The HF-named weights (`config`'s family's names, torch layout, float32 numpy) of a
    `KimiDeltaAttention`'s parameters `params` (`nnx.split`'s state): the inverse of `load_layer_weights`'
    layout. The layout maps are linear, so a gradient state of the parameters (`jax.vjp` of the layer with
    respect to them) maps to the gradients of the HF weights the same way."""

    def value(path: tuple[str, ...]) -> np.ndarray:
        node = params
        for attr in path:
            node = node[attr]
        return np.asarray(node[...], np.float32)

    shapes = canonical_weight_shapes(config)
    fused = config.kda_family.conv == FUSED_CONV
    canonical = {
        name: np.asarray(value(path).T if to_jax is _transposed else value(path)).reshape(shapes[name])
        for name, (path, to_jax) in _PARAM_MAP.items()
        if to_jax is not _conv_taps
    }
    taps = (
        [value(("conv1d",))[:, i] for i in range(len(CANONICAL_CONVS))]
        if fused
        else [value((name.removesuffix(".weight"),)) for name in CANONICAL_CONVS]
    )  # each [W, P]
    canonical.update({name: tap.T[:, None, :] for name, tap in zip(CANONICAL_CONVS, taps)})
    return family_weights(config, canonical)


def layer_from_hf_weights(
    config: KDAConfig,
    layer_idx: int,
    weights: Mapping[str, np.ndarray],
    dtype: Any = jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
    source: str = "the weights dict",
    layer_class: type[KimiDeltaAttention] = KimiDeltaAttention,
) -> KimiDeltaAttention:
    """A `layer_class` (`KimiDeltaAttention` or a subclass) holding `weights`, built without a random
    initialisation first."""
    module = nnx.eval_shape(lambda: layer_class(config, layer_idx, mesh, dtype, rngs=nnx.Rngs(0)))
    load_layer_weights(module, weights, source)
    return module


def layer_from_checkpoint(
    config: KDAConfig,
    folder: str | Path,
    layer_idx: int,
    dtype: Any = jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
) -> KimiDeltaAttention:
    """Layer `layer_idx` of the safetensors checkpoint in `folder` as a `KimiDeltaAttention`.

    Read by `kda_spec.checkpoint.read_checkpoint_layer`: its CheckpointError is a ValueError (a missing
    file also a FileNotFoundError, a missing tensor also a KeyError) that names the file, key or shard.
    """
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
