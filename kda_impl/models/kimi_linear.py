"""`KimiDeltaAttention`: the KDA layer of Kimi-Linear as a Flax NNX module (RFC §4.6), and of every
family of `kda_spec.families`: the config's family sets the conv's parameters (three `[W, P]` taps, or
one fused `conv1d` `[W, 3, P]`) and the decay gate's form (softplus, or the lower bound L).

Forward of one packed batch `x [T, hidden]` (docs: the kda-layer spec, steps 1-9):
projections → q|k|v short conv with per-request state + silu → l2norm(q, k) → decay gate g and beta
(fp32) → the recurrence through `RadixLinearAttention` and the backend → gated RMSNorm per head (fp32) →
o_proj. In a bf16 run the weights and activations are bf16 except A_log / dt_bias, and a value is rounded
to bf16 exactly where the hub's layer (`modeling_kimi.py` on fla's kernels, the RFC's ground truth)
stores one, each through `_rounded`: every projection's output, the short conv once after its silu, the
kernel's output, the output norm's, o_proj's. In between, fp32: the conv's sum and silu, the gate g,
beta's sigmoid, l2norm, the kernel, the norm. docs/bf16-rounding.md lists every point beside what the
hub and transformers' port do there, with the float64 measurements behind each choice.

Parallelism (docs/parallelism.md): the forward always runs under `jax.shard_map` over the layer's mesh
(axes `data` and `tensor`, `kda_impl.parallel.make_mesh`; without one, the 1 x 1 mesh of the first
device). Each tensor rank computes its H / tp heads end to end — projections, conv, gate, beta, the
kernel, the gated norm — and its rows of o_proj; one psum over `tensor` adds the partial outputs. Each
data rank serves its own requests on its own pool slots. `PARAM_SPECS` says how each parameter is split.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from kda_impl.kernels.common import HIGHEST, kda_gate, l2norm
from kda_impl.layers.radix_linear_attention import RadixLinearAttention
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardBatch
from kda_impl.parallel.mesh import (
    DATA_AXIS,
    TENSOR_AXIS,
    check_heads_divisible,
    mesh_sizes,
    single_device_mesh,
)
from kda_spec.config import KDAConfig
from kda_spec.families import FUSED_CONV

# The layout of each parameter on the mesh, by its path in the module. P = H * D is head-major, so a
# contiguous split of a P axis over `tensor` is a split of whole heads: the columns of q/k/v and of the
# gate and output-gate up-projections, the conv channels, A_log, dt_bias and b_proj's columns go with
# their heads; o_proj is row-parallel; the rank-D bottlenecks f_a / g_a and o_norm are replicated.
PARAM_SPECS: dict[tuple[str, ...], PartitionSpec] = {
    ("q_proj", "kernel"): PartitionSpec(None, TENSOR_AXIS),  # [hidden, P]
    ("k_proj", "kernel"): PartitionSpec(None, TENSOR_AXIS),  # [hidden, P]
    ("v_proj", "kernel"): PartitionSpec(None, TENSOR_AXIS),  # [hidden, P]
    ("q_conv1d",): PartitionSpec(None, TENSOR_AXIS),  # [W, P]
    ("k_conv1d",): PartitionSpec(None, TENSOR_AXIS),  # [W, P]
    ("v_conv1d",): PartitionSpec(None, TENSOR_AXIS),  # [W, P]
    ("conv1d",): PartitionSpec(None, None, TENSOR_AXIS),  # [W, 3, P] a fused family's q | k | v taps
    ("f_a_proj", "kernel"): PartitionSpec(),  # [hidden, D]
    ("f_b_proj", "kernel"): PartitionSpec(None, TENSOR_AXIS),  # [D, P]
    ("A_log",): PartitionSpec(TENSOR_AXIS),  # [H]
    ("dt_bias",): PartitionSpec(TENSOR_AXIS, None),  # [H, D]
    ("b_proj", "kernel"): PartitionSpec(None, TENSOR_AXIS),  # [hidden, H]
    ("g_a_proj", "kernel"): PartitionSpec(),  # [hidden, D]
    ("g_b_proj", "kernel"): PartitionSpec(None, TENSOR_AXIS),  # [D, P]
    ("o_norm", "weight"): PartitionSpec(),  # [D]
    ("o_proj", "kernel"): PartitionSpec(TENSOR_AXIS, None),  # [P, hidden]
}
TOKEN_ROWS = PartitionSpec(DATA_AXIS)  # [T, ...]: each data rank's tokens, the same on every tensor rank
TOKEN_HEADS = PartitionSpec(DATA_AXIS, TENSOR_AXIS)  # [T, H, ...]: tokens over data, heads over tensor


def param_specs(params: nnx.State) -> nnx.State:
    """The `PartitionSpec` of every parameter of a `KimiDeltaAttention` state, as a tree like it."""

    def spec(path: tuple[Any, ...], _: Any) -> PartitionSpec:
        name = tuple(key.key for key in path if isinstance(key, jax.tree_util.DictKey))
        if name not in PARAM_SPECS:
            raise ValueError(f"parameter {'.'.join(name)} has no layout in PARAM_SPECS")
        return PARAM_SPECS[name]

    return jax.tree_util.tree_map_with_path(spec, params)


class GatedRMSNorm(nnx.Module):
    """RMSNorm over the last axis times `sigmoid(gate)`, computed in fp32, cast back to `dtype`."""

    def __init__(self, dim: int, eps: float, dtype: Any):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(
        self,
        x: jax.Array,  # [..., D]
        gate: jax.Array,  # [..., D]
    ) -> jax.Array:
        x = x.astype(jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        gated = normed * self.weight[...].astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
        return gated.astype(self.dtype)


class KimiDeltaAttention(nnx.Module):
    """One KDA layer. Parameters are JAX layout: a Linear's `kernel` is `[in, out]` (HF weight transposed),
    the conv taps `q/k/v_conv1d` are `[W, P]` (a fused family's one `conv1d` `[W, 3, P]`), `A_log` `[H]`
    and `dt_bias` `[H, D]` fp32.

    `mesh`: where the layer runs (axes `data`, `tensor`); its tensor axis must divide the head count.
    Parameters are created unplaced; `kda_impl.weights` loads them onto the mesh (`PARAM_SPECS`).
    """

    #: Every matmul of the layer (the projections and o_proj), called with precision=HIGHEST.
    dot_general: Callable[..., jax.Array] = staticmethod(jax.lax.dot_general)

    def __init__(
        self,
        config: KDAConfig,
        layer_idx: int,
        mesh: jax.sharding.Mesh | None = None,
        dtype: Any = jnp.bfloat16,
        *,
        rngs: nnx.Rngs,
    ):
        if config.kda_layers and not config.is_kda_layer(layer_idx):
            raise ValueError(
                f"layer {layer_idx} is not a KDA layer of {config.preset!r} "
                f"(1-based kda_layers={config.kda_layers})"
            )
        self.mesh = single_device_mesh() if mesh is None else mesh
        _, tp = mesh_sizes(self.mesh)
        check_heads_divisible(config.num_heads, tp)
        self.config = config
        self.layer_idx = layer_idx
        self.dtype = dtype
        hidden, heads, dim, width, proj = (
            config.hidden_size,
            config.num_heads,
            config.head_dim,
            config.conv_size,
            config.proj_dim,
        )

        def linear(n_in: int, n_out: int) -> nnx.Linear:
            return nnx.Linear(
                n_in,
                n_out,
                use_bias=False,
                dtype=dtype,
                param_dtype=dtype,
                precision=HIGHEST,
                dot_general=self.dot_general,
                rngs=rngs,
            )

        self.q_proj, self.k_proj, self.v_proj = (
            linear(hidden, proj),
            linear(hidden, proj),
            linear(hidden, proj),
        )
        conv_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=())
        if config.kda_family.conv == FUSED_CONV:
            self.conv1d = nnx.Param(conv_init(rngs.params(), (width, 3, proj), dtype))
        else:
            self.q_conv1d = nnx.Param(conv_init(rngs.params(), (width, proj), dtype))
            self.k_conv1d = nnx.Param(conv_init(rngs.params(), (width, proj), dtype))
            self.v_conv1d = nnx.Param(conv_init(rngs.params(), (width, proj), dtype))
        self.f_a_proj, self.f_b_proj = linear(hidden, dim), linear(dim, proj)
        # fla's initialisation: A = U(1, 16); dt log-uniform in [1e-3, 1e-1], dt_bias its inverse softplus.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (heads,), jnp.float32, 1.0, 16.0)))
        dt = jnp.exp(jax.random.uniform(rngs.params(), (heads, dim), jnp.float32, np.log(1e-3), np.log(1e-1)))
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        self.b_proj = linear(hidden, heads)
        self.g_a_proj, self.g_b_proj = linear(hidden, dim), linear(dim, proj)
        self.o_norm = GatedRMSNorm(dim, config.rms_norm_eps, dtype)
        self.o_proj = linear(proj, hidden)
        self.attn = RadixLinearAttention(
            layer_id=layer_idx, num_heads=heads // tp, head_k_dim=dim, head_v_dim=dim, conv_size=width
        )

    def __call__(
        self,
        hidden_states: jax.Array,  # [T, hidden]
        positions: jax.Array,  # i32[T]; unused by KDA (no rotary), kept for the decoder-layer signature
        forward_batch: ForwardBatch,
        recurrent_state_pool: RecurrentStatePool,
        *,
        return_intermediates: bool = False,
    ) -> tuple[jax.Array, RecurrentStatePool] | tuple[jax.Array, RecurrentStatePool, dict[str, jax.Array]]:
        """`(out [T, hidden], pool)`, plus the dump-named intermediates when `return_intermediates`:
        `q/k/v_after_conv` `[T, H, D]` (after conv + silu, before l2norm), `g` `[T, H, D]` fp32,
        `beta` `[T, H]` fp32, `g_out` `[T, H, D]` (before sigmoid), `o_norm` `[T, H, D]`.

        Runs under `shard_map` over the layer's mesh: the arrays are global (hidden states and outputs
        split over `data`, the pool as `RecurrentStatePool.partition_specs` says); each device runs
        `_forward_shard` on its share.
        """
        self._check_inputs(hidden_states, forward_batch, recurrent_state_pool)
        graphdef, params = nnx.split(self)
        pool_specs = recurrent_state_pool.partition_specs()

        def shard(
            params: nnx.State, hidden_states: jax.Array, forward_batch: ForwardBatch, pool: RecurrentStatePool
        ) -> tuple[Any, ...]:
            layer = nnx.merge(graphdef, params)
            return layer._forward_shard(hidden_states, forward_batch, pool, return_intermediates)

        out_specs = (TOKEN_ROWS, pool_specs) + ((TOKEN_HEADS,) if return_intermediates else ())
        return jax.shard_map(
            shard,
            mesh=self.mesh,
            in_specs=(param_specs(params), TOKEN_ROWS, forward_batch.partition_specs(), pool_specs),
            out_specs=out_specs,
            # Pallas calls declare no varying mesh axes on their outputs; the one collective is explicit.
            check_vma=False,
        )(params, hidden_states, forward_batch, recurrent_state_pool)

    def _forward_shard(
        self,
        hidden_states: jax.Array,  # [T, hidden] this data rank's tokens
        forward_batch: ForwardBatch,  # this data rank's requests
        pool: RecurrentStatePool,  # this data rank's slots, this tensor rank's heads
        return_intermediates: bool,
    ) -> tuple[Any, ...]:
        """The forward on one device: its data rank's tokens through its tensor rank's heads."""
        tokens = hidden_states.shape[0]
        heads, dim = self.attn.num_heads, self.config.head_dim
        x = self._rounded(hidden_states)

        mixed_qkv = self._rounded(
            jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        )  # [T, 3P]
        conv_weight = self._conv_taps()  # [W, 3P]
        # fla's fused short conv with silu (the hub's): the conv summed in fp32 from the rounded projections,
        # silu in fp32, one rounding. fp32 conv inputs are the rounded values exactly, so is the new state.
        conv_out, new_conv_state = self.attn.short_conv(
            forward_batch, mixed_qkv.astype(jnp.float32), conv_weight, pool
        )
        qkv = self._rounded(jax.nn.silu(conv_out)).reshape(tokens, 3, heads, dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [T, H, D] each

        g = self._decay(x)  # [T, H, D] fp32
        beta = self._beta(x)  # [T, H] fp32
        o, pool = self.attn(
            forward_batch, l2norm(q), l2norm(k), v.astype(jnp.float32), g, beta, new_conv_state, pool
        )
        o = self._rounded(o)  # [T, H, D]

        g_out = self._rounded(self.g_b_proj(self._rounded(self.g_a_proj(x)))).reshape(tokens, heads, dim)
        o_norm = self._rounded(self.o_norm(o, g_out))
        # Row-parallel o_proj: this rank's heads times their rows of the kernel, summed over the ranks
        # in fp32 and rounded once.
        partial = self.dot_general(
            o_norm.reshape(tokens, heads * dim),
            self.o_proj.kernel[...],
            (((1,), (0,)), ((), ())),
            precision=HIGHEST,
            preferred_element_type=jnp.float32,
        )
        out = self._rounded(jax.lax.psum(partial, TENSOR_AXIS))
        if not return_intermediates:
            return out, pool
        intermediates = {
            "q_after_conv": q,
            "k_after_conv": k,
            "v_after_conv": v,
            "g": g,
            "beta": beta,
            "o_kda": o,  # the kernel's output, rounded to the run dtype
            "g_out": g_out,
            "o_norm": o_norm,
        }
        return out, pool, intermediates

    def _conv_taps(self) -> jax.Array:
        """The q | k | v short conv's taps `[W, 3P]` (this rank's P): the three convs side by side, or
        the fused family's one conv flattened."""
        if self.config.kda_family.conv == FUSED_CONV:
            taps = self.conv1d[...]  # [W, 3, P]
            return taps.reshape(taps.shape[0], -1)
        return jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=-1)

    def _decay(
        self,
        x: jax.Array,  # [T, hidden]
    ) -> jax.Array:
        """Per-channel log decay from `f = f_b(f_a(x)) + dt_bias`: `-exp(A_log[h]) * softplus(f)`, or the
        lower-bound family's `L * sigmoid(exp(A_log[h]) * f)`: `[T, H, D]` fp32."""
        heads, dim = self.attn.num_heads, self.config.head_dim
        f = self._rounded(self.f_b_proj(self._rounded(self.f_a_proj(x)))).astype(jnp.float32)
        f = f.reshape(-1, heads, dim)
        return kda_gate(f, self.A_log[...][:, None], self.dt_bias[...], self.config.gate_lower_bound)

    def _beta(self, x: jax.Array) -> jax.Array:
        """`beta = sigmoid(b_proj(x))`, the sigmoid in fp32 on the projection rounded to the run dtype (the
        hub's `b_proj(x).float().sigmoid()`; transformers rounds the sigmoid to bf16 too): `[T, H]` fp32."""
        return jax.nn.sigmoid(self._rounded(self.b_proj(x)).astype(jnp.float32))

    def _rounded(self, x: jax.Array) -> jax.Array:
        """`x` rounded to the run dtype, in the run dtype: one of the layer's bf16 rounding points.

        XLA may compute a bf16 op in fp32 and drop the f32 → bf16 → f32 convert pair when an fp32 op
        consumes its result (excess precision); `reduce_precision` on the fp32 value is a rounding XLA
        keeps. In fp32 runs a plain cast to fp32.
        """
        info = jnp.finfo(self.dtype)
        if info.bits == 32:
            return x.astype(self.dtype)
        wide = x.astype(jnp.float32)
        rounded = jax.lax.reduce_precision(wide, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        return rounded.astype(self.dtype)

    def _check_inputs(
        self,
        hidden_states: jax.Array,  # [T, hidden]
        forward_batch: ForwardBatch,
        pool: RecurrentStatePool,
    ) -> None:
        """Static shape checks (they hold while tracing), each naming the offending shape."""
        cfg = self.config
        if hidden_states.ndim != 2 or hidden_states.shape[1] != cfg.hidden_size:
            raise ValueError(
                f"hidden_states must be [T, hidden={cfg.hidden_size}], got {hidden_states.shape}"
            )
        if hidden_states.shape[0] != forward_batch.num_tokens:
            raise ValueError(
                f"hidden_states has {hidden_states.shape[0]} tokens but the batch is padded to "
                f"{forward_batch.num_tokens}; pad it with pad_rows(x, forward_batch.num_tokens)"
            )
        rec_shape, conv_shape = pool.recurrent_buffer.shape[2:], pool.conv_buffer.shape[2:]
        want_rec = (cfg.num_heads, cfg.head_dim, cfg.head_dim)
        want_conv = (cfg.conv_size - 1, 3, cfg.proj_dim)
        if rec_shape != want_rec or conv_shape != want_conv:
            raise ValueError(
                f"the pool holds states [H, D, D]={rec_shape} and conv [W-1, 3, P]={conv_shape}, but layer "
                f"{self.layer_idx} needs {want_rec} and {want_conv}"
            )
        dp, _ = mesh_sizes(self.mesh)
        if forward_batch.dp_size != dp or pool.dp_size != dp:
            raise ValueError(
                f"layer {self.layer_idx} runs on a mesh with dp={dp} data ranks, but the batch has "
                f"dp_size={forward_batch.dp_size} and the pool dp_size={pool.dp_size}; build them for the "
                f"same mesh (make_dp_forward_batch, RecurrentStatePool.create(..., mesh=))"
            )


@dataclasses.dataclass(frozen=True)
class JittedForward:
    """A layer's jitted forward `step(params, hidden_states, forward_batch, pool)` bound to `params`:
    called as `(hidden_states [T, hidden], forward_batch, pool) -> (out, pool[, intermediates])`, the pool
    donated and the returned one holding the allocators of the one passed (`with_allocators_of`)."""

    step: Callable[..., tuple[Any, ...]]
    params: nnx.State

    def __call__(
        self, hidden_states: Any, forward_batch: ForwardBatch, pool: RecurrentStatePool
    ) -> tuple[Any, ...]:
        out, new_pool, *rest = self.step(self.params, hidden_states, forward_batch, pool)
        return (out, new_pool.with_allocators_of(pool), *rest)  # the allocators stay on the host

    def with_params(self, params: nnx.State) -> JittedForward:
        """The same compiled step bound to other parameters of the same shapes (no recompilation)."""
        return dataclasses.replace(self, params=params)


def jit_forward(module: KimiDeltaAttention, *, return_intermediates: bool = False) -> JittedForward:
    """`module`'s forward, jitted once, with the pool donated (XLA updates its buffers in place).

    Returns `forward(hidden_states [T, hidden], forward_batch, pool) -> (out, pool[, intermediates])`.
    The parameters are captured now: reload weights → call `jit_forward` again (or `with_params`).
    Compiles once per bucket of `make_forward_batch` (and per forward mode), shared by every pool of one
    shape (`SlotLayout`). The pool passed in is consumed: use the returned one, which holds the same
    allocators. Host arrays are fine as hidden states and batch, also in a multi-process run, where every
    process passes the same values.
    """
    graphdef, params = nnx.split(module)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(params, hidden_states, forward_batch, pool):
        layer = nnx.merge(graphdef, params)
        return layer(
            hidden_states,
            forward_batch.positions,
            forward_batch,
            pool,
            return_intermediates=return_intermediates,
        )

    return JittedForward(step, params)


def jit_vjp(module: KimiDeltaAttention) -> Callable[..., tuple[nnx.State, jax.Array, jax.Array]]:
    """`module`'s vector-Jacobian product, jitted: training's backward of one extend forward.

    Returns `vjp(params, hidden_states [T, hidden], forward_batch, pool, slot_rows i32[N], initial_state
    [N, H, D, D], dout [T, hidden], dht [N, H, D, D]) -> (d params, d hidden_states, d initial_state)`: the
    gradients of `sum(out * dout) + sum(final_states * dht)`, where the batch's N requests start from
    `initial_state` in their pool rows `slot_rows` (their conv states as the pool holds them) and
    `final_states` are those rows' recurrent states after the forward. The pool is read, not donated or
    changed. `params` is `nnx.split(module)`'s state (`hf_weights_of` names its gradients); the backward
    is JAX's autodiff of the forward, its chunk kernel's `lax.scan` included (Pallas kernels have none).
    """
    graphdef, _ = nnx.split(module)
    layer_id = module.layer_idx

    @jax.jit
    def vjp(params, hidden_states, forward_batch, pool, slot_rows, initial_state, dout, dht):
        def forward(params: nnx.State, hidden_states: jax.Array, initial_state: jax.Array) -> tuple[Any, ...]:
            _, conv = pool.get_slot_states(layer_id, slot_rows)
            started = pool.set_linear_recurrent_layer_cache(layer_id, slot_rows, initial_state, conv)
            layer = nnx.merge(graphdef, params)
            out, after = layer(hidden_states, forward_batch.positions, forward_batch, started)
            final, _ = after.get_slot_states(layer_id, slot_rows)
            return out, final

        (out, final), pullback = jax.vjp(forward, params, hidden_states, initial_state)
        return pullback((dout.astype(out.dtype), dht.astype(final.dtype)))

    return vjp
