"""The built-in adapter: drives kda_impl through its serving path.

`KimiDeltaAttention` → `RadixLinearAttention` → `KDAAttnBackend` → `kda_impl.kernels`, with the states
in a `RecurrentStatePool`: every call allocates one slot per sequence, writes the sequence's starting
state into it, runs the jitted forward (pool donated; one compilation per batch bucket), reads the new
states back into the carry and frees the slots.

The layer runs on a mesh of `tp` x `dp` devices, its options (`--impl-option tp=N --impl-option dp=M`,
or the shorthands `--tp N --dp M`; default 1 each): heads split over `tensor`, and the sequences of each
call dealt out round-robin to the data ranks, each on its own slots. The report's `describe` records the
mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conformance.adapter import (
    KERNEL_GRADIENTS,
    CheckpointKernelAdapter,
    GradientAdapter,
    KernelAdapter,
    LayerAdapter,
    LayerGradientAdapter,
    LayerResult,
    RawGateKernelAdapter,
    ServingAdapter,
)
from conformance.adapters.kda_impl_serving import MIN_DRAFT_TOKENS, REQUEST_BUCKET, KDAImplServing
from kda_impl.kernels import chunk_kda, fused_recurrent_kda, resolve_kernel
from kda_impl.kernels.chunk import CHUNK_SIZE as PLAIN_CHUNK_SIZE
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import (
    MIN_REQUEST_BUCKET,
    MIN_TOKEN_BUCKET,
    ForwardMode,
    bucket,
    make_dp_forward_batch,
    seq_lens_from_cu_seqlens,
)
from kda_impl.models.kimi_linear import KimiDeltaAttention, jit_forward, jit_vjp
from kda_impl.parallel import make_mesh, mesh_sizes
from kda_impl.weights import hf_weights_of, layer_from_hf_weights
from kda_spec.families import FAMILIES
from kda_spec.layer_vjp import HIDDEN_STATES_GRADIENT, INITIAL_STATE_GRADIENT
from kda_spec.truth import chunk_starts

RUN_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class KDACarry:
    """The states of N sequences after a call, to continue them (chunked prefill or decode)."""

    recurrent: jax.Array  # [N, H, D, D] fp32
    conv: jax.Array  # [N, W-1, 3, P] in the run dtype

    @property
    def num_seqs(self) -> int:
        return self.recurrent.shape[0]


class KDAImplAdapter(
    LayerAdapter,
    KernelAdapter,
    RawGateKernelAdapter,
    CheckpointKernelAdapter,
    GradientAdapter,
    LayerGradientAdapter,
    ServingAdapter,
):
    """kda_impl under test; `kernel` is 'auto' (the dispatcher's choice), 'naive' or 'pallas'; the options
    `tp` and `dp` size the mesh."""

    name = "kda_impl"
    OPTIONS: ClassVar[Mapping[str, str]] = {
        "tp": "tensor-parallel size: heads over N devices (default 1)",
        "dp": "data-parallel size: sequences over M data ranks (default 1)",
    }
    FAMILIES: ClassVar[frozenset[str]] = frozenset(FAMILIES)
    # The layer and backend classes it builds its serving path from (a broken or defective adapter swaps one).
    layer_class: type[KimiDeltaAttention] = KimiDeltaAttention
    backend_class: ClassVar[type[KDAAttnBackend]] = KDAAttnBackend
    # The pool class of its serving path (`serving_open`; a defective adapter swaps it).
    serving_pool_class: ClassVar[type[RecurrentStatePool]] = RecurrentStatePool
    # The scheduler glue of its serving path (a defective adapter swaps it).
    serving_class: ClassVar[type[KDAImplServing]] = KDAImplServing

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._run_dtype = RUN_DTYPES[self.dtype]
        self._kernel = None if self.kernel == "auto" else self.kernel
        self._mesh = make_mesh(tp=self.options["tp"], dp=self.options["dp"])
        # The first KDA layer of the model (layer 0 when the config lists none, as a dump's does).
        self._layer_idx = min((i - 1 for i in self.config.kda_layers), default=0)
        module = self._new_layer(self.weights, "the dump's weights")
        self._backend = self.backend_class(kernel=self._kernel)
        # The layer's backward runs on the plain-JAX kernels, under `auto` too (its Pallas kernels have none;
        # on a TPU `auto` picks them for the forward), as the chunk kernel's vjp does.
        self._vjp_backend = self.backend_class(kernel="naive")
        self._forward = jit_forward(module, return_intermediates=True)
        self._params = nnx.split(module)[1]
        self._vjp = jit_vjp(module)
        self._pool: RecurrentStatePool | None = None
        self._serving: KDAImplServing | None = None
        # The chunk kernel of the kernel checks returns its state entering every chunk too (fla's
        # `return_intermediate_states`: the same o and final states, to the bit on golden): one program
        # serves `chunk_kernel` and `chunk_kernel_checkpoints`.
        self._chunk_size = default_chunk_size(self._kernel)
        self._chunk = jitted_kernel("chunk", self._kernel, checkpoints_every=self._chunk_size)
        self._recurrent = jitted_kernel("fused_recurrent", self._kernel)

    def _new_layer(self, weights: Mapping[str, np.ndarray], source: str) -> KimiDeltaAttention:
        """The layer holding `weights` (named in errors as `source`), on this adapter's mesh, in its run
        dtype."""
        return layer_from_hf_weights(
            self.config, self._layer_idx, weights, self._run_dtype, self._mesh, source, self.layer_class
        )

    @classmethod
    def parse_options(cls, options: Mapping[str, str]) -> dict[str, Any]:
        """{"tp": int, "dp": int}, each a positive integer (1 when not given) that this host's devices
        can hold (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices)."""
        super().parse_options(options)
        sizes = {key: options.get(key, "1") for key in cls.OPTIONS}
        for key, text in sizes.items():
            if not text.strip().isdigit() or int(text) < 1:
                raise ValueError(f"adapter {cls.name!r}: option {key}={text!r} must be a positive integer")
        parsed = {key: int(text) for key, text in sizes.items()}
        make_mesh(parsed["tp"], parsed["dp"])  # a ValueError names the devices missing
        return parsed

    @property
    def kernel_used(self) -> str:
        return self._backend.kernel_used

    def describe(self) -> dict[str, Any]:
        dp, tp = mesh_sizes(self._mesh)
        return {
            "jax": jax.__version__,
            "device": str(jax.devices()[0]),
            "kernel": self.kernel_used,
            "layer_idx": self._layer_idx,
            "mesh": {"tp": tp, "dp": dp, "devices": self._mesh.size, "processes": jax.process_count()},
        }

    # --- layer ----------------------------------------------------------------------------------------

    def layer_extend(
        self,
        hidden_states: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None = None,
        carry: KDACarry | None = None,
    ) -> LayerResult:
        seq_lens = seq_lens_from_cu_seqlens(cu_seqlens, hidden_states.shape[0])
        num_seqs = seq_lens.size
        if initial_state is not None and carry is not None:
            raise ValueError("pass initial_state (fresh sequences) or carry (continued ones), not both")
        if initial_state is not None:
            expected = (num_seqs, self.config.num_heads, self.config.head_dim, self.config.head_dim)
            if initial_state.shape != expected:
                raise ValueError(
                    f"initial_state must be [N, H, D, D]={expected} for the {num_seqs} sequences of "
                    f"cu_seqlens, got {initial_state.shape}"
                )
            conv_shape = (num_seqs, self.config.conv_size - 1, 3, self.config.proj_dim)
            carry = KDACarry(
                recurrent=jnp.asarray(initial_state, jnp.float32),
                conv=jnp.zeros(conv_shape, self._run_dtype),
            )
        self._check_carry(carry, num_seqs)
        return self._run(ForwardMode.EXTEND, hidden_states, seq_lens, carry)

    def layer_decode(self, hidden_states: np.ndarray, carry: KDACarry) -> LayerResult:
        if carry is None:
            raise ValueError("layer_decode continues the sequences of a carry; got carry=None")
        self._check_carry(carry, hidden_states.shape[0])
        return self._run(ForwardMode.DECODE, hidden_states, np.ones(carry.num_seqs, np.int64), carry)

    def _check_carry(self, carry: KDACarry | None, num_seqs: int) -> None:
        if carry is None:
            return
        if not isinstance(carry, KDACarry):
            raise TypeError(f"carry must come from this adapter (a KDACarry), got {type(carry).__name__}")
        if carry.num_seqs != num_seqs:
            raise ValueError(f"the carry holds {carry.num_seqs} sequences, the call has {num_seqs}")

    def _run(
        self,
        mode: ForwardMode,
        hidden_states: np.ndarray,  # [T, hidden] float32
        seq_lens: np.ndarray,  # [N]
        carry: KDACarry | None,
    ) -> LayerResult:
        num_seqs = seq_lens.size
        try:
            batch, pool, slots, pool_rows, token_rows = self._prepared(
                mode, seq_lens, MIN_TOKEN_BUCKET, self._backend
            )
            if carry is not None:
                carried = _with_states(pool, self._layer_idx, pool_rows, carry.recurrent, carry.conv)
                pool = carried.with_allocators_of(pool)
            x = _scattered(hidden_states, token_rows, batch.num_tokens)
            out, pool, intermediates = self._forward(x.astype(self._run_dtype), batch, pool)
            new_carry = KDACarry(*_states_of(pool, self._layer_idx, pool_rows))
        except BaseException:
            self._pool = None  # its buffers may have been donated to the failed call: start afresh
            raise
        self._release(pool, slots)
        named = {name: _to_numpy(value)[token_rows] for name, value in intermediates.items()}
        named["final_conv_state"] = _to_numpy(new_carry.conv).reshape(num_seqs, self.config.conv_size - 1, -1)
        return LayerResult(
            out=_to_numpy(out)[token_rows],
            final_state=_to_numpy(new_carry.recurrent),
            carry=new_carry,
            intermediates=named,
        )

    def _prepared(
        self, mode: ForwardMode, seq_lens: np.ndarray, min_tokens: int, backend: KDAAttnBackend
    ) -> tuple[Any, RecurrentStatePool, list[Any], np.ndarray, np.ndarray]:
        """A forward batch of N sequences of `seq_lens` (padded to at least `min_tokens` tokens) for
        `backend`, dealt out round-robin to the data ranks, each on fresh zeroed slots of the adapter's
        pool: (batch, pool, each rank's slots, each sequence's pool row i32[N], each token's batch row
        i64[T], in the caller's order). `_release` frees the slots."""
        dp, _ = mesh_sizes(self._mesh)
        num_seqs = seq_lens.size
        ranks = [np.arange(rank, num_seqs, dp) for rank in range(dp)]  # sequences dealt round-robin
        pool = self._pool_with_room(max(seqs.size for seqs in ranks))
        slots = [pool.alloc(seqs.size, dp_rank=rank) for rank, seqs in enumerate(ranks)]  # zeroed
        batch = make_dp_forward_batch(
            backend,
            mode,
            [seq_lens[seqs] for seqs in ranks],
            [pool.get_recurrent_indices(rank_slots, rank) for rank, rank_slots in enumerate(slots)],
            num_slots=pool.num_slots,
            min_tokens=token_bucket(max(int(seq_lens[seqs].sum()) for seqs in ranks), min_tokens),
            min_requests=REQUEST_BUCKET,
        )
        pool_rows = np.empty(num_seqs, np.int32)
        token_rows = np.empty(int(seq_lens.sum()), np.int64)
        starts = np.cumsum(seq_lens) - seq_lens
        for rank, seqs in enumerate(ranks):
            pool_rows[seqs] = pool.rows(slots[rank], rank)
            for seq, rows in zip(seqs, batch.request_rows(rank, seq_lens[seqs])):
                token_rows[starts[seq] : starts[seq] + seq_lens[seq]] = rows
        return batch, pool, slots, pool_rows, token_rows

    def _release(self, pool: RecurrentStatePool, slots: list[Any]) -> None:
        """Free each rank's `slots` of `pool` and keep it as the adapter's pool."""
        for rank, rank_slots in enumerate(slots):
            pool.free(rank_slots, rank)
        self._pool = pool

    # --- the layer's gradients ------------------------------------------------------------------------

    def layer_vjp(self, hidden_states, cu_seqlens, initial_state, dout, dht):
        """The layer's gradients by JAX's autodiff of its extend forward (`jit_vjp`) on its plain-JAX
        kernels, on the batch padded to the kernel calls' token bucket (one compilation serves every case
        up to 1024 tokens), the cotangents of the padding zeros. kda_impl's Pallas kernels have no
        backward: with `--kernel pallas` this raises NotImplementedError (the checks skip)."""
        if self._kernel == "pallas":
            raise NotImplementedError("kda_impl's Pallas kernels have no backward; its plain-JAX layer has")
        seq_lens = seq_lens_from_cu_seqlens(cu_seqlens, hidden_states.shape[0])
        num_seqs = seq_lens.size
        init = np.zeros((num_seqs, self.config.num_heads, self.config.head_dim, self.config.head_dim))
        if initial_state is not None:
            init = initial_state
        try:
            batch, pool, slots, pool_rows, token_rows = self._prepared(
                ForwardMode.EXTEND, seq_lens, KERNEL_MIN_TOKEN_BUCKET, self._vjp_backend
            )
            x = _scattered(hidden_states, token_rows, batch.num_tokens).astype(self._run_dtype)
            # The sequences padded to the request bucket, as the batch's requests are (one compilation
            # for every N up to it): the padding's rows the dummy slot 0, its states zeros, cotangents zero.
            padded_seqs = bucket(num_seqs, REQUEST_BUCKET)
            init, dht = (_padded(np.asarray(a, np.float32), padded_seqs) for a in (init, dht))
            d_params, dx, d_init = self._vjp(
                self._params, x, batch, pool, _padded(pool_rows, padded_seqs), init,
                _scattered(dout, token_rows, batch.num_tokens), dht,
            )  # fmt: skip
        except BaseException:
            self._pool = None  # as `_run`: start afresh
            raise
        self._release(pool, slots)
        return {
            **hf_weights_of(self.config, d_params),
            HIDDEN_STATES_GRADIENT: _to_numpy(dx)[token_rows],
            INITIAL_STATE_GRADIENT: _to_numpy(np.asarray(d_init)[:num_seqs]),
        }

    def _pool_with_room(self, num_seqs: int) -> RecurrentStatePool:
        """The adapter's pool, rebuilt larger (a power of two) when `num_seqs` slots per rank do not fit."""
        if self._pool is None or self._pool.num_slots < num_seqs:
            self._pool = RecurrentStatePool.create(
                self.config,
                bucket(num_seqs, MIN_REQUEST_BUCKET),
                self._run_dtype,
                layer_ids=(self._layer_idx,),
                mesh=self._mesh,
            ).with_draft_tokens(MIN_DRAFT_TOKENS)  # as the serving pool: their programs are the same
        return self._pool

    # --- serving (docs/serving.md) -------------------------------------------------------------------

    def serving_open(self, num_slots: int) -> None:
        dp, _ = mesh_sizes(self._mesh)
        if dp != 1:
            raise NotImplementedError(f"the serving path runs on one data rank; this mesh has dp={dp}")
        pool = self.serving_pool_class.create(
            self.config, num_slots, self._run_dtype, layer_ids=(self._layer_idx,), mesh=self._mesh
        ).with_draft_tokens(MIN_DRAFT_TOKENS)  # every forward compiles once with them, a verify's too
        self._serving = self.serving_class(
            self.config, self._layer_idx, self._run_dtype, self._backend, self._forward, pool, token_bucket
        )

    def serving_alloc(self) -> int:
        return self._open_serving().alloc()

    def serving_free(self, slot: int) -> None:
        self._open_serving().free(slot)

    def serving_forward(self, mode, hidden_states, seq_lens, slots, prefix_lens, padding_rows):
        return self._open_serving().run(mode, hidden_states, seq_lens, slots, prefix_lens, padding_rows)

    def serving_state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        return self._open_serving().state(slot)

    def serving_copy(self, src: int, dst: int) -> None:
        self._open_serving().copy(src, dst)

    def serving_load(self, slot: int, recurrent: np.ndarray, conv: np.ndarray) -> None:
        self._open_serving().load(slot, recurrent, conv)

    def serving_accept(self, slot: int, accepted: int) -> None:
        self._open_serving().accept(slot, accepted)

    def _open_serving(self) -> KDAImplServing:
        if self._serving is None:
            raise ValueError("no serving pool is open: call serving_open(num_slots) first")
        return self._serving

    # --- kernels --------------------------------------------------------------------------------------

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        return self._kernel_call(self._chunk, q, k, v, g, beta, cu_seqlens, initial_state)

    def recurrent_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        return self._kernel_call(self._recurrent, q, k, v, g, beta, cu_seqlens, initial_state)

    def chunk_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        kernel = jitted_kernel("chunk", self._kernel, raw_gate=True, lower_bound=lower_bound)
        gate = {"A_log": a_log, "dt_bias": dt_bias}
        return self._kernel_call(kernel, q, k, v, g_raw, beta, cu_seqlens, initial_state, gate)

    def recurrent_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        kernel = jitted_kernel("fused_recurrent", self._kernel, raw_gate=True, lower_bound=lower_bound)
        gate = {"A_log": a_log, "dt_bias": dt_bias}
        return self._kernel_call(kernel, q, k, v, g_raw, beta, cu_seqlens, initial_state, gate)

    def chunk_kernel_checkpoints(self, q, k, v, g, beta, cu_seqlens, initial_state, chunk_size):
        """The states `chunk_kernel`'s program returns (fla's `h`, every `self._chunk_size` tokens) at the
        starts of the chunks of `chunk_size` tokens: every (chunk_size / own chunk size)-th of them."""
        own = self._chunk_size
        if chunk_size % own:
            raise NotImplementedError(
                f"kda_impl's chunk kernel here returns its states every {own} tokens: no checkpoints every "
                f"{chunk_size}"
            )
        results = self._on_buckets(self._chunk, q, k, v, g, beta, cu_seqlens, initial_state)
        if len(results) < 3:  # a subclass's chunk program of (o, final state) alone
            raise NotImplementedError(f"adapter {self.name!r}: its chunk program returns no per-chunk states")
        h = results[2]
        # h [1, NC, H, D, D]: the real sequences' chunks first, in fla's order, then the padding's.
        lens = np.diff(cu_seqlens).tolist()
        index = {start: row for row, start in enumerate(chunk_starts(lens, own))}
        return _to_numpy(np.asarray(h)[0, [index[start] for start in chunk_starts(lens, chunk_size)]])

    def chunk_kernel_vjp(self, q, k, v, g, beta, cu_seqlens, initial_state, do, dht):
        """The plain-JAX chunk kernel's gradients by JAX's autodiff (`jitted_kernel_vjp`), on the call
        padded as `_kernel_call` pads it, the cotangents of the padding zeros. kda_impl's Pallas kernels
        have no backward: with `--kernel pallas` this raises NotImplementedError (the checks skip)."""
        if self._kernel == "pallas":
            raise NotImplementedError(
                "kda_impl's Pallas kernels have no backward; its plain-JAX chunk kernel has"
            )
        tokens, num_seqs = q.shape[0], len(cu_seqlens) - 1
        padded_tokens, padded_seqs = kernel_buckets(tokens, num_seqs)
        do = _padded(np.asarray(do, np.float32), padded_tokens)[None]
        dht = _padded(np.asarray(dht, np.float32), padded_seqs)
        grads = self._on_buckets(
            jitted_kernel_vjp(), q, k, v, g, beta, cu_seqlens, initial_state, do=do, dht=dht
        )
        per_token = {name: np.asarray(grad)[0, :tokens] for name, grad in zip(KERNEL_GRADIENTS[:5], grads)}
        return {
            name: _to_numpy(grad)
            for name, grad in {**per_token, "dh0": np.asarray(grads[5])[:num_seqs]}.items()
        }

    def _kernel_call(
        self,
        kernel: Callable[..., tuple[jax.Array, ...]],  # (o, final state[, h])
        q: np.ndarray,  # [T, H, D] l2-normalised
        k: np.ndarray,  # [T, H, D] l2-normalised
        v: np.ndarray,  # [T, H, D]
        g: np.ndarray,  # [T, H, D] fp32: the log decay, or the raw gate with `gate`
        beta: np.ndarray,  # [T, H] fp32
        cu_seqlens: np.ndarray,  # i32[N+1]
        initial_state: np.ndarray | None,  # [N, H, D, D] fp32
        gate: Mapping[str, np.ndarray] | None = None,  # the raw gate's A_log [H] and dt_bias [H·D], fp32
    ) -> tuple[np.ndarray, np.ndarray]:
        """As the layer feeds the kernel: q, k l2-normalised in fp32 (never re-rounded), v rounded to the
        run dtype and held in fp32 (the kernel upcasts it exactly, so one compiled kernel serves both runs),
        g, beta and the states fp32; o rounded to the run dtype, as the reference kernel returns it. With
        `gate`, `g` is the raw gate and the kernel takes the gate's parameters as keywords."""
        o, final, *_ = self._on_buckets(kernel, q, k, v, g, beta, cu_seqlens, initial_state, gate)
        tokens, num_seqs = q.shape[0], len(cu_seqlens) - 1
        o = np.asarray(o)[0, :tokens].astype(np.dtype(self._run_dtype))
        return _to_numpy(o), _to_numpy(np.asarray(final)[:num_seqs])

    def _on_buckets(
        self,
        kernel: Callable[..., tuple[jax.Array, ...]],
        q: np.ndarray,  # [T, H, D] l2-normalised
        k: np.ndarray,  # [T, H, D] l2-normalised
        v: np.ndarray,  # [T, H, D]
        g: np.ndarray,  # [T, H, D] fp32: the log decay, or the raw gate with `gate`
        beta: np.ndarray,  # [T, H] fp32
        cu_seqlens: np.ndarray,  # i32[N+1]
        initial_state: np.ndarray | None,  # [N, H, D, D] fp32
        gate: Mapping[str, np.ndarray] | None = None,  # the raw gate's A_log [H] and dt_bias [H·D], fp32
        **more: np.ndarray,  # keywords `kernel` takes beside them, already padded (a vjp's cotangents)
    ) -> tuple[jax.Array, ...]:
        """`kernel`'s results on the call padded to the buckets (`_kernel_call`'s inputs): its real
        tokens and sequences first, then the padding's."""
        seq_lens = seq_lens_from_cu_seqlens(cu_seqlens, q.shape[0])  # the jitted kernel cannot check values
        tokens, num_seqs = q.shape[0], seq_lens.size
        # Conversions in numpy (bf16 casts round to nearest even, as XLA's): on the device each one would
        # be one more small executable to compile per shape.
        v = np.asarray(v, np.float32).astype(np.dtype(self._run_dtype)).astype(np.float32)
        # Padded to the layer's buckets, as the layer's prefill is padded, so that the kernel compiles once
        # per bucket pair, not per case: the padding tokens (zeros: they leave a state unchanged) form one
        # padding sequence, the other padding sequences are empty; their results are dropped. A missing
        # initial state is passed as zeros (what the kernel starts from without one): one compilation
        # serves both.
        padded_tokens, padded_seqs = kernel_buckets(tokens, num_seqs)
        init = np.zeros((num_seqs, *q.shape[1:], v.shape[-1]), np.float32)
        if initial_state is not None:
            init = np.asarray(initial_state, np.float32)
        q, k, v, g, beta = (
            _padded(np.asarray(x, np.float32), padded_tokens)[None] for x in (q, k, v, g, beta)
        )
        cu = np.full(padded_seqs + 1, padded_tokens, np.int32)
        cu[: num_seqs + 1] = cu_seqlens
        parameters = {name: np.asarray(value, np.float32) for name, value in (gate or {}).items()}
        return kernel(
            q, k, v, g, beta, initial_state=_padded(init, padded_seqs), cu_seqlens=cu, **parameters, **more
        )


@functools.cache
def jitted_kernel(
    path: str,
    kernel: str | None,
    *,
    checkpoints_every: int | None = None,
    raw_gate: bool = False,
    lower_bound: float | None = None,
) -> Callable[..., Any]:
    """kda_impl's jitted `path` kernel ("chunk" or "fused_recurrent") on `kernel` (None: the
    dispatcher's choice), returning the final state; with `checkpoints_every` C, the chunk kernel runs
    chunks of C tokens and returns its state entering each too (fla's `return_intermediate_states`); with
    `raw_gate`, it takes the raw gate, `A_log` [H] and `dt_bias` [H·K] (fla's `use_gate_in_kernel=True`)
    for the gate of lower bound `lower_bound` (None: softplus). One per process and set of arguments, so
    that every adapter (the fp32 and the bf16 run's) shares its compilations: the kernel checks feed it
    fp32 in both runs."""
    function = {"chunk": chunk_kda, "fused_recurrent": fused_recurrent_kda}[path]
    options: dict[str, Any] = {"output_final_state": True, "kernel": kernel}
    if checkpoints_every is not None:
        options.update(return_intermediate_states=True, chunk_size=checkpoints_every)
    if raw_gate:
        options.update(use_gate_in_kernel=True, lower_bound=lower_bound)
    return jax.jit(functools.partial(function, **options))


# The kernel calls' token buckets start at 1024: one compilation per kernel and form serves every case up
# to 1024 tokens (the vjp's, the chunk kernel's forward and backward scans, takes about 5 s to compile on
# XLA:CPU; a 1024-token call of golden's size runs in 43 ms where a 64-token one took 9 ms). The longer
# padding moves a few roundings: on golden 13 of 932 checks' numbers (two varlen cases of 64 tokens),
# the largest a gate ratio from 0.103 to 0.106, no check's status.
KERNEL_MIN_TOKEN_BUCKET = MIN_TOKEN_BUCKET * 16


def kernel_buckets(tokens: int, num_seqs: int) -> tuple[int, int]:
    """The tokens and sequences a kernel call of `tokens` tokens in `num_seqs` sequences is padded to
    (`_on_buckets`; a vjp's cotangents alike): at least `KERNEL_MIN_TOKEN_BUCKET` tokens, and room for one
    padding sequence."""
    return token_bucket(tokens, KERNEL_MIN_TOKEN_BUCKET), bucket(num_seqs + 1, MIN_REQUEST_BUCKET)


@functools.cache
def jitted_kernel_vjp() -> Callable[..., Any]:
    """kda_impl's plain-JAX chunk kernel's vector-Jacobian product, jitted: `(q, k, v, g, beta [1, T, ...],
    initial_state [N, H, K, V], cu_seqlens, do [1, T, H, V], dht [N, H, K, V])` → the gradients of q, k, v,
    g, beta and the initial state (`KERNEL_GRADIENTS`' order), by JAX's autodiff of the kernel (its
    `lax.scan` over chunks). One per process, shared by the fp32 and the bf16 run."""

    def vjp(q, k, v, g, beta, *, initial_state, cu_seqlens, do, dht):
        def kernel(q, k, v, g, beta, initial_state):
            return chunk_kda(
                q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                cu_seqlens=cu_seqlens, kernel="naive",
            )  # fmt: skip

        _, pullback = jax.vjp(kernel, q, k, v, g, beta, initial_state)
        return pullback((do, dht))

    return jax.jit(vjp)


def default_chunk_size(kernel: str | None) -> int:
    """The tokens per chunk kda_impl's `chunk_kda` runs with by default under `kernel` (None: auto): the
    plain-JAX kernel's (32, the fastest on XLA:CPU) or the Pallas kernel's (64, fla's)."""
    if resolve_kernel(kernel) == "pallas":
        from kda_impl.kernels.pallas.tuning import CHUNK_SIZE as PALLAS_CHUNK_SIZE

        return PALLAS_CHUNK_SIZE
    return PLAIN_CHUNK_SIZE


def token_bucket(tokens: int, smallest: int = MIN_TOKEN_BUCKET) -> int:
    """The token count a call of `tokens` tokens is padded to: `smallest` × a power of 16 (64, 1024,
    16384), far coarser than the layer's own power-of-two buckets. Over golden's lengths that is
    2 token buckets where powers of two take 5, so a cold run compiles the layer and each kernel fewer
    times, at up to 16× the padding (cheap at the sizes a conformance run checks on a CPU). Golden's
    results are the same to the bit as with power-of-two buckets. One bucket for every call would not
    be: XLA:CPU rounds a dot of 64 rows differently from one of 1024, which moves fp32 roundings."""
    padded = smallest
    while padded < tokens:
        padded *= 16
    return padded


# A layer call's carried states into the adapter's pool (`(pool, layer_id, rows i32[N], recurrent
# [N, H, D, D], conv [N, W-1, 3, P])` → the pool, without allocators: `with_allocators_of`) and out of it
# (`(pool, layer_id, rows)` → `(recurrent, conv)`), one jitted program each: op by op, their indexing
# costs about 14 ms a call on a CPU, seconds over a run. The rows are the adapter's own (`pool.rows`);
# traced, `safe_rows` routes rather than checks them.
_with_states = jax.jit(RecurrentStatePool.set_linear_recurrent_layer_cache, static_argnums=1)
_states_of = jax.jit(RecurrentStatePool.get_slot_states, static_argnums=1)


def _scattered(x: np.ndarray, token_rows: np.ndarray, rows: int) -> np.ndarray:
    """`x` [T, ...] float32 at its tokens' batch rows `token_rows` of a batch of `rows` rows, zeros
    elsewhere."""
    scattered = np.zeros((rows, *x.shape[1:]), np.float32)
    scattered[token_rows] = x
    return scattered


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` [n, ...] with zero rows appended up to `rows`."""
    return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


def _to_numpy(x: jax.Array | np.ndarray) -> np.ndarray:
    """float32 numpy (bf16 values upcast exactly), converted on the host."""
    return np.asarray(x).astype(np.float32)
