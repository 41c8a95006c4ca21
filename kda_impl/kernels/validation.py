"""Input validation shared by every KDA kernel implementation.

`static_validate_inputs` checks shapes and dtypes (works while tracing); `dynamic_validate_cu_seqlens`
checks the offsets' values and only runs on concrete arrays (outside `jit`), as the serving layer calls it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.common import KdaInputs


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """Static sizes of one kernel call: B batch rows, T tokens per row, N sequences, H heads, K, V."""

    batch: int
    tokens: int
    num_seqs: int
    heads: int
    key_dim: int
    value_dim: int

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """(N, H, K, V): the initial and final states of the call."""
        return (self.num_seqs, self.heads, self.key_dim, self.value_dim)


def static_validate_inputs(
    inputs: KdaInputs,  # [B, T, H, ...] as the caller gives them
    initial_state: jax.Array | None,  # [N, H, K, V]
    cu_seqlens: jax.Array | None,  # i32[N + 1]
) -> KernelShapes:
    """Check the dtypes are floating point and the shapes agree, naming the offending argument; return
    the sizes."""
    validate_float_inputs(**inputs._asdict())
    q, k, v, g, beta = inputs
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
    batch, tokens, heads, key_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k.shape={k.shape} must equal q.shape={q.shape}")
    if g.shape != q.shape:
        raise ValueError(f"g.shape={g.shape} must equal q.shape={q.shape} (per-channel log decay)")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q {q.shape[:3]}, got {v.shape}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta.shape={beta.shape} must be [B, T, H]={q.shape[:3]}")
    value_dim = v.shape[3]
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B=1, got B={batch}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be [N+1] with N >= 1, got shape {cu_seqlens.shape}")
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must be integer offsets, got dtype {cu_seqlens.dtype}")
        num_seqs = cu_seqlens.shape[0] - 1
        dynamic_validate_cu_seqlens(cu_seqlens, tokens)
    else:
        num_seqs = batch
    if initial_state is not None:
        expected = (num_seqs, heads, key_dim, value_dim)
        if initial_state.shape != expected:
            raise ValueError(
                f"initial_state.shape={initial_state.shape} must be [N, H, K, V]={expected} "
                f"(N={num_seqs} sequences)"
            )
    return KernelShapes(batch, tokens, num_seqs, heads, key_dim, value_dim)


def validate_float_inputs(**arrays: jax.Array) -> None:
    """Refuse integer, bool or complex kernel inputs (they would be truncated or cast), naming the array."""
    for name, array in arrays.items():
        dtype = array.dtype if hasattr(array, "dtype") else np.result_type(array)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {dtype}")


def dynamic_validate_cu_seqlens(cu_seqlens: jax.Array | np.ndarray, total_tokens: int) -> None:
    """Check offsets start at 0, never decrease and end at `total_tokens`; no-op under tracing."""
    if isinstance(cu_seqlens, jax.core.Tracer):
        return
    offsets = np.asarray(cu_seqlens)
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={offsets[0]} in {offsets.tolist()}")
    steps = np.diff(offsets)
    if np.any(steps < 0):
        bad = int(np.argmax(steps < 0))
        raise ValueError(
            f"cu_seqlens must be non-decreasing: cu_seqlens[{bad}]={offsets[bad]} > "
            f"cu_seqlens[{bad + 1}]={offsets[bad + 1]} in {offsets.tolist()}"
        )
    if offsets[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens must end at the token count T={total_tokens}, got cu_seqlens[-1]={offsets[-1]}"
        )


def validate_gate_inputs(
    use_gate_in_kernel: bool,
    a_log: jax.Array | None,  # [H]
    dt_bias: jax.Array | None,  # [H, K] or [H * K]
    g: jax.Array,  # [..., H, K] the raw gate
) -> tuple[jax.Array, jax.Array] | None:
    """The in-kernel gate's parameters as fp32 `([H], [H, K])` (dt_bias zeros when None), or None without
    the option; a ValueError names a missing, misshapen or unwanted one."""
    if not use_gate_in_kernel:
        if a_log is not None or dt_bias is not None:
            raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True")
        return None
    heads, key_dim = jnp.shape(g)[-2:]
    if a_log is None:
        raise ValueError(f"use_gate_in_kernel=True needs A_log of shape [H]=({heads},), got None")
    if jnp.shape(a_log) != (heads,):
        raise ValueError(f"A_log.shape={jnp.shape(a_log)} must be [H]=({heads},)")
    if dt_bias is None:
        dt_bias = jnp.zeros((heads, key_dim), jnp.float32)
    if jnp.shape(dt_bias) not in ((heads, key_dim), (heads * key_dim,)):
        raise ValueError(f"dt_bias.shape={jnp.shape(dt_bias)} must be [H, K]={(heads, key_dim)} or [H * K]")
    return jnp.asarray(a_log, jnp.float32), jnp.asarray(dt_bias, jnp.float32).reshape(heads, key_dim)
