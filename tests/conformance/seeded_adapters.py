"""Seeded defects for `conformance search` (docs/search.md, "Seeded defects"): each an adapter of its
own, the built-in `KDAImplAdapter` with one serving-path bug that no fixed case of the suite was built
to catch. The search must find each unaided.

- `RunningSumDecay`: the chunk kernel's decay factors come from differences of fp32 running sums of
  `g` within each 64-token chunk (sgl-jax's failure mode): `exp(G_i - G_j)` loses about ulp(|G|) in
  the exponent once strong decays sum to hundreds;
- `StateDroppedAtChunkBoundary`: a sequence whose length is a multiple of 64 returns the state it
  started from: the prefill's update of the state is dropped;
- `ConvOffByOneAfterSplit`: a prefill continuing a carry (the next piece of a chunked prefill) reads
  the carried conv window one token off: the oldest position zeroed, the newest input lost;
- `TransposedInitialState`: an initial state is applied transposed ([V, K] read as [K, V]).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from conformance.adapter import LayerResult
from conformance.adapters.kda_impl_adapter import KDACarry, KDAImplAdapter
from kda_impl.kernels import chunk_kda
from kda_impl.kernels.common import sequence_ids
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend

CHUNK = 64  # fla's chunk, as sgl-jax's kernel uses


def _positions(tokens: int, cu_seqlens: jax.Array) -> jax.Array:
    """i32[T]: each token's position in its sequence."""
    return jnp.arange(tokens) - cu_seqlens[sequence_ids(cu_seqlens, tokens)]


def running_sum_decays(g: jax.Array, cu_seqlens: jax.Array) -> jax.Array:
    """`g` [1, T, H, K] as differences of its fp32 running sums within each `CHUNK`-token chunk of each
    sequence (`cu_seqlens` i32[N+1]): g'_t = G_t - G_(t-1), so that the decay from token j to token i
    is exp(G_i - G_j) of the rounded sums, as a kernel computing it from running sums has it."""
    tokens = g.shape[1]
    starts = (_positions(tokens, cu_seqlens) % CHUNK == 0)[None, :, None, None]

    Pair = tuple[jax.Array, jax.Array]

    def combine(a: Pair, b: Pair) -> Pair:
        (start_a, sum_a), (start_b, sum_b) = a, b
        return start_a | start_b, jnp.where(start_b, sum_b, sum_a + sum_b)

    starts = jnp.broadcast_to(starts, g.shape)
    _, sums = jax.lax.associative_scan(combine, (starts, g.astype(jnp.float32)), axis=1)
    previous = jnp.where(starts, 0.0, jnp.roll(sums, 1, axis=1))
    return sums - previous


def drop_boundary_states(
    final: jax.Array, initial_state: jax.Array | None, cu_seqlens: jax.Array
) -> jax.Array:
    """`final` [N, H, K, V], with the state each sequence started from (zeros without `initial_state`)
    wherever the sequence's length is a positive multiple of `CHUNK`."""
    lengths = jnp.diff(cu_seqlens)
    dropped = ((lengths > 0) & (lengths % CHUNK == 0))[:, None, None, None]
    start = jnp.zeros_like(final) if initial_state is None else initial_state
    return jnp.where(dropped, start, final)


@jax.tree_util.register_pytree_node_class
class RunningSumBackend(KDAAttnBackend):
    """The backend whose prefill chunk kernel takes its decays from running sums."""

    def _dispatch_chunk(self, q, k, v, g, beta, *, initial_state, cu_seqlens, scale):
        g = running_sum_decays(g, cu_seqlens)
        return super()._dispatch_chunk(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, scale=scale
        )


@jax.tree_util.register_pytree_node_class
class BoundaryDropBackend(KDAAttnBackend):
    """The backend whose prefill drops the state of a sequence that ends on a chunk boundary."""

    def _dispatch_chunk(self, q, k, v, g, beta, *, initial_state, cu_seqlens, scale):
        o, final = super()._dispatch_chunk(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, scale=scale
        )
        return o, drop_boundary_states(final, initial_state, cu_seqlens)


def _defective_chunk(kernel: str | None, defect: str) -> Any:
    """`chunk_kda` with `defect` ("running-sum" or "boundary-drop"), jitted, as the adapter's kernel call."""

    def chunk(q, k, v, g, beta, *, initial_state, cu_seqlens):
        if defect == "running-sum":
            g = running_sum_decays(g, cu_seqlens)
        o, final = chunk_kda(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
            output_final_state=True, kernel=kernel,
        )  # fmt: skip
        if defect == "boundary-drop":
            final = drop_boundary_states(final, initial_state, cu_seqlens)
        return o, final

    return jax.jit(chunk)


class _ChunkDefect(KDAImplAdapter):
    """A defect of the chunk kernel, in the layer's prefill (`backend_class`) and in the chunk kernel
    check (`defect`, as `_defective_chunk` names it) alike."""

    defect: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._chunk = _defective_chunk(self._kernel, self.defect)


class RunningSumDecay(_ChunkDefect):
    """Decay factors from differences of fp32 running sums, in the layer and in the chunk kernel check."""

    name = "seeded: decays from running sums"
    backend_class = RunningSumBackend
    defect = "running-sum"


class StateDroppedAtChunkBoundary(_ChunkDefect):
    """A prefilled sequence of a multiple of 64 tokens keeps its starting state."""

    name = "seeded: state dropped at a chunk boundary"
    backend_class = BoundaryDropBackend
    defect = "boundary-drop"


def conv_off_by_one(carry: KDACarry) -> KDACarry:
    """`carry` with its conv window [N, W-1, 3, P] shifted by one token: the oldest position zeroed,
    the newest input lost."""
    conv = carry.conv
    shifted = jnp.concatenate([jnp.zeros_like(conv[:, :1]), conv[:, :-1]], axis=1)
    return dataclasses.replace(carry, conv=shifted)


class ConvOffByOneAfterSplit(KDAImplAdapter):
    """The next piece of a chunked prefill continues from a conv window one token off."""

    name = "seeded: conv state off by one after a split"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None) -> LayerResult:
        if isinstance(carry, KDACarry):
            carry = conv_off_by_one(carry)
        return super().layer_extend(hidden_states, cu_seqlens, initial_state, carry)


class TransposedInitialState(KDAImplAdapter):
    """Initial states applied transposed, in the layer and in both kernels (and their raw-gate form)."""

    name = "seeded: initial state transposed"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None) -> LayerResult:
        return super().layer_extend(hidden_states, cu_seqlens, _transposed(initial_state), carry)

    def _kernel_call(self, kernel, q, k, v, g, beta, cu_seqlens, initial_state, gate=None):
        return super()._kernel_call(kernel, q, k, v, g, beta, cu_seqlens, _transposed(initial_state), gate)


def _transposed(state: np.ndarray | None) -> np.ndarray | None:
    """[N, H, K, V] → its key and value axes swapped."""
    return None if state is None else np.ascontiguousarray(np.swapaxes(state, -1, -2))


SEEDED = {
    "running-sum-decay": RunningSumDecay,
    "state-dropped-at-chunk-boundary": StateDroppedAtChunkBoundary,
    "conv-off-by-one-after-split": ConvOffByOneAfterSplit,
    "transposed-initial-state": TransposedInitialState,
}
