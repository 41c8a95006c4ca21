"""`RadixLinearAttention`: the layer → backend dispatch entry of linear-recurrent layers (RFC §4.3.0).

It holds the layer's attention metadata (id, heads, dims, scale) and forwards to
`forward_batch.attn_backend`, which owns the state I/O and the ForwardMode dispatch. Under tensor
parallelism `num_heads` is the heads of one tensor shard, as the arrays it is called with carry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx

if TYPE_CHECKING:
    from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
    from kda_impl.model_executor.forward_batch import ForwardBatch


class RadixLinearAttention(nnx.Module):
    """Metadata of one linear-recurrent layer and its entry into the attention backend."""

    def __init__(self, layer_id: int, num_heads: int, head_k_dim: int, head_v_dim: int, conv_size: int):
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_size = conv_size
        self.scaling = head_k_dim**-0.5

    def short_conv(
        self,
        forward_batch: ForwardBatch,
        mixed_qkv: jax.Array,  # [T, C] q | k | v projections
        conv_weight: jax.Array,  # [W, C]
        recurrent_state_pool: RecurrentStatePool,
    ) -> tuple[jax.Array, jax.Array]:
        """The causal short conv continuing each request's conv state: `(y [T, C], new_state [N, W-1, C])`."""
        return forward_batch.attn_backend.apply_short_conv(
            self, forward_batch, mixed_qkv, conv_weight, recurrent_state_pool
        )

    def __call__(
        self,
        forward_batch: ForwardBatch,
        q: jax.Array,  # [T, H, K]
        k: jax.Array,  # [T, H, K]
        v: jax.Array,  # [T, H, V]
        g: jax.Array,  # [T, H, K] fp32 log decay
        beta: jax.Array,  # [T, H] fp32
        new_conv_state: jax.Array,  # [N, W-1, C]
        recurrent_state_pool: RecurrentStatePool,
    ) -> tuple[jax.Array, RecurrentStatePool]:
        """The recurrence for this step's mode: `(o [T, H, V], the pool with this layer's new states)`."""
        heads = (q.shape[1], k.shape[1], v.shape[1], g.shape[1], beta.shape[1])
        if any(h != self.num_heads for h in heads):
            raise ValueError(
                f"layer {self.layer_id} has {self.num_heads} heads; q, k, v, g, beta carry {heads}"
            )
        return forward_batch.attn_backend.forward(
            self, forward_batch, q, k, v, g, beta, new_conv_state, recurrent_state_pool
        )
