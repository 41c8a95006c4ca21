"""The layout conversions between this harness (HF names, torch layout) and sglang-jax's KDA layer.

numpy only, so that they are tested without sglang-jax (tests/examples/test_sglang_jax_adapter.py).
What sglang-jax expects, as read from its public code:

- a projection (`LinearBase`) computes `x @ weight` with `weight [in, out]`: the HF `[out, in]`
  transposed;
- a short conv weight is `[P, W]` (depthwise, `short_convolution`): the HF `[P, 1, W]` without its
  singleton axis;
- `A_log [1, 1, H, 1]`, `dt_bias [P]`, `o_norm.weight [D]` as in HF;
- a recurrent state is `[N, H, K, V]`, key before value, as the harness's `[N, H, D, D]`;
- a conv state is `[N, 3P, W-1]` (q, k, v channels, then time) where the dump's `final_conv_state`
  is `[N, W-1, 3P]`;
- `cu_seqlens` is int32 `[N+1]` starting at 0.
"""

from __future__ import annotations

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.families import CANONICAL_CONVS, canonical_weights
from kda_spec.weight_names import PROJECTIONS, hf_weight_shapes

UNCHANGED = ("A_log", "dt_bias", "o_norm.weight")


def sglang_jax_params(config: KDAConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named float32 weights (the config's family's names) → sglang-jax's `KimiDeltaAttention`
    parameters, by attribute path.

    Keys are `q_proj.weight`, `q_conv1d.weight`, `A_log`, ... as the attributes of sglang-jax's
    module; a missing or misshapen HF weight is a ValueError naming it.
    """
    for name, shape in hf_weight_shapes(config).items():
        if name not in weights:
            raise ValueError(f"weights: missing {name!r} (expected shape {shape})")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weights: {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
    weights = canonical_weights(config, weights)
    params = {f"{name}.weight": np.ascontiguousarray(weights[f"{name}.weight"].T) for name in PROJECTIONS}
    params.update({name: np.ascontiguousarray(weights[name][:, 0, :]) for name in CANONICAL_CONVS})
    params.update({name: np.asarray(weights[name]) for name in UNCHANGED})
    return params


def check_state(initial_state: np.ndarray, config: KDAConfig, num_seqs: int) -> np.ndarray:
    """The harness's `[N, H, K, V]` initial state as sglang-jax's (the same axes), float32."""
    expected = (num_seqs, config.num_heads, config.head_dim, config.head_dim)
    if initial_state.shape != expected:
        raise ValueError(
            f"initial_state must be [N, H, K, V]={expected} for the {num_seqs} sequences of "
            f"cu_seqlens, got {initial_state.shape}"
        )
    return np.asarray(initial_state, np.float32)


def conv_state_to_dump(conv_state: np.ndarray) -> np.ndarray:
    """sglang-jax's conv state `[N, 3P, W-1]` → the dump's `final_conv_state` `[N, W-1, 3P]`."""
    if conv_state.ndim != 3:
        raise ValueError(f"conv state must be [N, 3P, W-1], got shape {conv_state.shape}")
    return np.ascontiguousarray(np.swapaxes(conv_state, 1, 2))


def seq_lens_of(cu_seqlens: np.ndarray, num_tokens: int) -> np.ndarray:
    """The sequence lengths of an int `cu_seqlens [N+1]` over `num_tokens` tokens, checked."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D int array of N+1 >= 2 offsets, got {cu.dtype} {cu.shape}")
    lens = np.diff(cu)
    if cu[0] != 0 or cu[-1] != num_tokens or np.any(lens < 1):
        raise ValueError(f"cu_seqlens {cu.tolist()} must rise from 0 to {num_tokens} tokens, by >= 1 each")
    return lens.astype(np.int32)
