"""Defects injected into the built-in implementation, to measure what the suite catches.

`DefectiveKDAImpl` is the built-in `KDAImplAdapter` with one defect switched on by `inject(Injection)`
between calls, without compiling the layer again: a changed weight (the parameters are an argument of
the jitted forward, swapped for new ones of the same shapes), a packed prefill that leaks each
sequence's final state into the next sequence's start (the leak weight is an array that travels through
jit with the batch), decode calls that forget the conv state. A moved bf16 rounding is a different
layer class (`BetaSigmoidInRunDtype`), given to the constructor: one compilation per class.
`python -m conformance power` (conformance/tools/power.py) drives it; the test suite's broken adapters reuse
the pieces.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conformance.adapter import LayerResult
from conformance.adapters.kda_impl_adapter import KDACarry, KDAImplAdapter
from kda_impl.kernels import chunk_kda
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.models.kimi_linear import KimiDeltaAttention
from kda_impl.parallel import mesh_sizes


class BetaSigmoidInRunDtype(KimiDeltaAttention):
    """The layer with one bf16 rounding moved: beta's sigmoid computed in the run dtype (bf16 in a bf16
    run) where the spec computes it in fp32. The same layer as the built-in one in an fp32 run."""

    def _beta(self, x: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(self._rounded(self.b_proj(x))).astype(jnp.float32)


def without_conv_state(carry: KDACarry) -> KDACarry:
    """`carry` with its conv state zeroed: what a decode that drops the conv state continues from."""
    return dataclasses.replace(carry, conv=jnp.zeros_like(carry.conv))


def chunk_with_state_leak(
    chunk: Callable[..., tuple[jax.Array, ...]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None,  # [N, H, K, V] or None (zeros)
    cu_seqlens: jax.Array,
    leak: jax.Array,  # scalar
    **kwargs: Any,
) -> tuple[jax.Array, ...]:
    """`chunk` (a `chunk_kda` with `output_final_state=True`, its per-chunk states too or not) on a
    packed batch whose sequences do not start clean: sequence i starts from its own initial state plus
    `leak` × the final state sequence i-1 reaches (as computed without the leak). With `leak` = 1, a
    kernel that never resets its state at a sequence boundary; 0 leaves the result as it was."""
    _, final, *_ = chunk(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, **kwargs)
    previous = jnp.concatenate([jnp.zeros_like(final[:1]), final[:-1]])
    start = leak * previous if initial_state is None else initial_state + leak * previous
    return chunk(q, k, v, g, beta, initial_state=start, cu_seqlens=cu_seqlens, **kwargs)


@jax.tree_util.register_pytree_node_class
class StateLeakBackend(KDAAttnBackend):
    """The KDA backend whose packed prefill leaks states across sequences (`chunk_with_state_leak`).

    `leak` is a float32 array [dp] (one entry per data rank, all equal), a pytree child: a new weight
    needs no new compilation."""

    def __init__(self, mesh: jax.sharding.Mesh | None = None, kernel: str | None = None):
        super().__init__(mesh, kernel)
        self.leak: jax.Array = jnp.zeros((1,), jnp.float32)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children, aux = super().tree_flatten()
        return (*children, self.leak), aux

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> StateLeakBackend:
        backend = super().tree_unflatten(aux, children[:-1])
        backend.leak = children[-1]
        return backend

    def _dispatch_chunk(self, q, k, v, g, beta, *, initial_state, cu_seqlens, scale):
        chunk = super()._dispatch_chunk
        return chunk_with_state_leak(
            chunk, q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
            leak=self.leak[0], scale=scale,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Injection:
    """What `DefectiveKDAImpl` breaks in its next calls; the default breaks nothing.

    weights: the layer's weights by HF name (fp32, torch layout) to run with in place of the dump's,
    cast to the run dtype as the built-in adapter casts them; state_leak: the weight of
    `chunk_with_state_leak` in every packed prefill (the layer's and the chunk kernel check's);
    drop_decode_conv: decode calls continue from a zeroed conv state."""

    weights: Mapping[str, np.ndarray] | None = None
    state_leak: float = 0.0
    drop_decode_conv: bool = False


class DefectiveKDAImpl(KDAImplAdapter):
    """The built-in adapter with a switchable defect (`inject`) and a layer class of choice."""

    name = "kda_impl with an injected defect"
    backend_class = StateLeakBackend

    def __init__(self, *args: Any, layer_class: type[KimiDeltaAttention] = KimiDeltaAttention, **kwargs: Any):
        """The built-in adapter's arguments, and the class of the layer to build."""
        self.layer_class = layer_class  # before the built-in adapter builds its layer with it
        super().__init__(*args, **kwargs)
        # The built-in forward; each `inject` binds its jitted step to new parameters (no recompilation).
        self._dump_forward = self._forward
        leaky_chunk = jax.jit(
            functools.partial(
                chunk_with_state_leak,
                functools.partial(
                    chunk_kda,
                    output_final_state=True,
                    return_intermediate_states=True,  # the checkpoints leak as the states do
                    chunk_size=self._chunk_size,
                    kernel=self._kernel,
                ),
            )
        )
        self._chunk = lambda *args, **kwargs: leaky_chunk(*args, leak=self._backend.leak[0], **kwargs)
        self.inject(Injection())

    def inject(self, injection: Injection) -> None:
        """Run the next calls with `injection`'s defect (`Injection()`: none)."""
        self._forward = self._dump_forward
        if injection.weights is not None:
            _, params = nnx.split(self._new_layer(injection.weights, "the injected weights"))
            self._forward = self._dump_forward.with_params(params)
        dp, _ = mesh_sizes(self._mesh)
        self._backend.leak = jnp.full((dp,), injection.state_leak, jnp.float32)
        self.injection = injection

    def layer_decode(self, hidden_states: np.ndarray, carry: KDACarry) -> LayerResult:
        if self.injection.drop_decode_conv and isinstance(carry, KDACarry):
            carry = without_conv_state(carry)
        return super().layer_decode(hidden_states, carry)
