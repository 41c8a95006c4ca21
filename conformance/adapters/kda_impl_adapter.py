"""The built-in adapter: drives kda_impl through its serving path.

`KimiDeltaAttention` → `RadixLinearAttention` → `KDAAttnBackend` → `kda_impl.kernels`, with the states
in a `RecurrentStatePool`: every call allocates one slot per sequence, writes the sequence's starting
state into it, runs the jitted forward (pool donated; one compilation per batch bucket), reads the new
states back into the carry and frees the slots.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conformance.adapter import KDAAdapter, LayerResult
from kda_impl.config import KDAConfig
from kda_impl.kernels import chunk_kda, fused_recurrent_kda
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import (
    MIN_REQUEST_BUCKET,
    ForwardMode,
    bucket,
    make_forward_batch,
    pad_rows,
    seq_lens_from_cu_seqlens,
)
from kda_impl.models.kimi_linear import jit_forward
from kda_impl.weights import layer_from_hf_weights

RUN_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class KDACarry:
    """The states of N sequences after a call, to continue them (chunked prefill or decode)."""

    recurrent: jax.Array  # [N, H, D, D] fp32
    conv: jax.Array  # [N, W-1, 3P] in the run dtype

    @property
    def num_seqs(self) -> int:
        return self.recurrent.shape[0]


class KDAImplAdapter(KDAAdapter):
    """kda_impl under test; `kernel` is 'auto' (the dispatcher's choice), 'naive' or 'pallas'."""

    name = "kda_impl"

    def __init__(self, config: KDAConfig, weights: dict[str, np.ndarray], dtype: str, kernel: str = "auto"):
        super().__init__(config, weights, dtype, kernel)
        if dtype not in RUN_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(RUN_DTYPES)}, got {dtype!r}")
        self._run_dtype = RUN_DTYPES[dtype]
        self._kernel = None if kernel == "auto" else kernel
        # The first KDA layer of the model (layer 0 when the config lists none, as a dump's does).
        self._layer_idx = min((i - 1 for i in config.kda_layers), default=0)
        module = layer_from_hf_weights(
            config, self._layer_idx, weights, self._run_dtype, source="the dump's weights"
        )
        self._backend = KDAAttnBackend(kernel=self._kernel)
        self._forward = jit_forward(module, return_intermediates=True)
        self._pool: RecurrentStatePool | None = None
        self._chunk = jax.jit(functools.partial(chunk_kda, output_final_state=True, kernel=self._kernel))
        self._recurrent = jax.jit(
            functools.partial(fused_recurrent_kda, output_final_state=True, kernel=self._kernel)
        )

    @property
    def kernel_used(self) -> str:
        return self._backend.kernel_used

    def describe(self) -> dict[str, Any]:
        return {
            "jax": jax.__version__,
            "device": str(jax.devices()[0]),
            "kernel": self.kernel_used,
            "layer_idx": self._layer_idx,
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
            carry = KDACarry(
                recurrent=jnp.asarray(initial_state, jnp.float32),
                conv=jnp.zeros((num_seqs, self.config.conv_size - 1, self.config.conv_dim), self._run_dtype),
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
        num_seqs, num_real = seq_lens.size, int(seq_lens.sum())
        pool = self._pool_with_room(num_seqs)
        slots = pool.alloc(num_seqs)  # zeroed: fresh sequences start from zeros
        try:
            if carry is not None:
                pool = pool.set_linear_recurrent_layer_cache(
                    self._layer_idx, jnp.asarray(slots), carry.recurrent, carry.conv
                )
            batch = make_forward_batch(self._backend, mode, seq_lens, pool.get_recurrent_indices(slots))
            x = jnp.asarray(
                pad_rows(np.asarray(hidden_states, np.float32), batch.num_tokens), self._run_dtype
            )
            out, pool, intermediates = self._forward(x, batch, pool)
            recurrent, conv = pool.get_linear_recurrent_layer_cache(self._layer_idx)
            new_carry = KDACarry(recurrent=recurrent[slots], conv=conv[slots])
        except BaseException:
            self._pool = None  # its buffers may have been donated to the failed call: start afresh
            raise
        pool.free(slots)
        self._pool = pool
        named = {name: _to_numpy(value[:num_real]) for name, value in intermediates.items()}
        named["final_conv_state"] = _to_numpy(new_carry.conv)
        return LayerResult(
            out=_to_numpy(out[:num_real]),
            final_state=_to_numpy(new_carry.recurrent),
            carry=new_carry,
            intermediates=named,
        )

    def _pool_with_room(self, num_seqs: int) -> RecurrentStatePool:
        """The adapter's pool, rebuilt larger (a power of two) when `num_seqs` slots do not fit."""
        if self._pool is None or self._pool.num_slots < num_seqs:
            self._pool = RecurrentStatePool.create(
                self.config,
                bucket(num_seqs, MIN_REQUEST_BUCKET),
                self._run_dtype,
                layer_ids=(self._layer_idx,),
            )
        return self._pool

    # --- kernels --------------------------------------------------------------------------------------

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        return self._kernel_call(self._chunk, q, k, v, g, beta, cu_seqlens, initial_state)

    def recurrent_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        return self._kernel_call(self._recurrent, q, k, v, g, beta, cu_seqlens, initial_state)

    def _kernel_call(
        self,
        kernel: Callable[..., tuple[jax.Array, jax.Array]],
        q: np.ndarray,  # [T, H, D] l2-normalised
        k: np.ndarray,  # [T, H, D] l2-normalised
        v: np.ndarray,  # [T, H, D]
        g: np.ndarray,  # [T, H, D] fp32
        beta: np.ndarray,  # [T, H] fp32
        cu_seqlens: np.ndarray,  # i32[N+1]
        initial_state: np.ndarray | None,  # [N, H, D, D] fp32
    ) -> tuple[np.ndarray, np.ndarray]:
        """q, k, v in the run dtype (as the layer feeds them), g, beta and the states fp32."""
        seq_lens_from_cu_seqlens(cu_seqlens, q.shape[0])  # the jitted kernel cannot check values
        q, k, v = (jnp.asarray(x, self._run_dtype)[None] for x in (q, k, v))
        g, beta = (jnp.asarray(x, jnp.float32)[None] for x in (g, beta))
        init = None if initial_state is None else jnp.asarray(initial_state, jnp.float32)
        o, final = kernel(q, k, v, g, beta, initial_state=init, cu_seqlens=jnp.asarray(cu_seqlens, jnp.int32))
        return _to_numpy(o[0]), _to_numpy(final)


def _to_numpy(x: jax.Array) -> np.ndarray:
    """float32 numpy (bf16 values upcast exactly)."""
    return np.asarray(jnp.asarray(x, jnp.float32))
