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
    """Static sizes of one kernel call: B batch rows, T tokens per row, N sequences, H q/k heads, HV value
    heads (HV = H, or a multiple of it with GVA), K, V; the states' layout."""

    batch: int
    tokens: int
    num_seqs: int
    heads: int
    key_dim: int
    value_dim: int
    value_heads: int
    state_v_first: bool = False

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """The initial and final states of the call: (N, HV, K, V), or (N, HV, V, K) `state_v_first`."""
        inner = (self.value_dim, self.key_dim) if self.state_v_first else (self.key_dim, self.value_dim)
        return (self.num_seqs, self.value_heads, *inner)


def static_validate_inputs(
    inputs: KdaInputs,  # q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]
    initial_state: jax.Array | None,  # [N, HV, K, V], or [N, HV, V, K] with state_v_first
    cu_seqlens: jax.Array | None,  # i32[N + 1]
    state_v_first: bool = False,
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
    if v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with B, T of q {q.shape[:2]}, got {v.shape}")
    value_heads, value_dim = v.shape[2:]
    if value_heads % heads:
        raise ValueError(
            f"v has HV={value_heads} heads, which must be a multiple of q's H={heads} (GVA: value head j "
            f"reads q/k head j // (HV / H))"
        )
    if g.shape != (batch, tokens, value_heads, key_dim):
        raise ValueError(
            f"g.shape={g.shape} must be [B, T, HV, K]={(batch, tokens, value_heads, key_dim)} "
            "(per-channel log decay)"
        )
    if beta.shape != (batch, tokens, value_heads):
        raise ValueError(f"beta.shape={beta.shape} must be [B, T, HV]={(batch, tokens, value_heads)}")
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
    shapes = KernelShapes(batch, tokens, num_seqs, heads, key_dim, value_dim, value_heads, state_v_first)
    if initial_state is not None and initial_state.shape != shapes.state_shape:
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        raise ValueError(
            f"initial_state.shape={initial_state.shape} must be {layout}={shapes.state_shape} "
            f"(N={num_seqs} sequences)"
        )
    return shapes


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
