"""What one forward step runs on: the mode, the token positions and the attention backend with its metadata.

`make_forward_batch` builds an EXTEND or DECODE batch outside `jit`, padding its sizes to buckets so
that a jitted forward compiles once per bucket, not once per set of lengths.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.validation import dynamic_validate_cu_seqlens
from kda_impl.mem_cache.recurrent_state_pool import DUMMY_SLOT

if TYPE_CHECKING:
    from kda_impl.layers.attention.linear.kda_backend import LinearRecurrentAttnBackend

MIN_TOKEN_BUCKET = 64
MIN_REQUEST_BUCKET = 8


class ForwardMode(enum.IntEnum):
    """The kind of step, as in sgl-jax. The KDA backend serves EXTEND, DECODE, IDLE and DUMMY_FIRST."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    DUMMY_FIRST = enum.auto()
    DRAFT_EXTEND = enum.auto()
    TARGET_VERIFY = enum.auto()

    def is_idle(self) -> bool:
        """No real request in the batch: attention returns zeros and leaves the states alone."""
        return self in (ForwardMode.IDLE, ForwardMode.DUMMY_FIRST)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """One step's batch: arrays (and the backend holding the metadata arrays) are pytree children,
    `forward_mode` is static aux data.
    """

    forward_mode: ForwardMode
    positions: jax.Array  # i32[T] position of each token in its request (0 for padding tokens)
    attn_backend: LinearRecurrentAttnBackend  # carries forward_metadata (cu_q_lens, recurrent_indices)

    @property
    def num_tokens(self) -> int:
        """T, the padded token count."""
        return self.positions.shape[0]

    @property
    def batch_size(self) -> int:
        """N, the padded request count."""
        return self.attn_backend.forward_metadata.recurrent_indices.shape[0]

    def replace(self, **changes: Any) -> ForwardBatch:
        return dataclasses.replace(self, **changes)

    def tree_flatten(self) -> tuple[tuple[Any, ...], ForwardMode]:
        return (self.positions, self.attn_backend), self.forward_mode

    @classmethod
    def tree_unflatten(cls, forward_mode: ForwardMode, children: tuple[Any, ...]) -> ForwardBatch:
        return cls(forward_mode, *children)


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def make_forward_batch(
    attn_backend: LinearRecurrentAttnBackend,
    forward_mode: ForwardMode,
    seq_lens: Sequence[int],
    recurrent_indices: Sequence[int] | np.ndarray,
    *,
    prefix_lens: Sequence[int] | None = None,
    min_tokens: int = MIN_TOKEN_BUCKET,
    min_requests: int = MIN_REQUEST_BUCKET,
) -> ForwardBatch:
    """Build a padded EXTEND or DECODE batch for N requests (outside `jit`).

    Args:
        attn_backend: the shared backend; the batch gets a copy bound to this batch's metadata.
        forward_mode: EXTEND (prefill / chunked prefill) or DECODE (one token per request).
        seq_lens: `[N]` new tokens of each request in this step (each 1 for DECODE; 0 allowed for EXTEND).
        recurrent_indices: `[N]` state-pool slot of each request, from
            `RecurrentStatePool.get_recurrent_indices` (validated there).
        prefix_lens: `[N]` tokens each request has already processed (for `positions`); zeros if None.
        min_tokens / min_requests: the smallest buckets.

    Bucketing (so a jitted forward compiles once per bucket pair, not per set of lengths):
        - EXTEND: the token count T is padded to `bucket(T, min_tokens)` and the request count to
          `bucket(N + 1, min_requests)`. The first padding request owns all padding tokens; the
          others are zero-length. Padding requests use the pool's dummy slot 0, so they never read
          or write a real slot. The caller pads `hidden_states` to `batch.num_tokens` rows (`pad_rows`).
        - DECODE: N is padded to `bucket(N, min_requests)` and T = N; each padding request has one
          padding token and the dummy slot.
        Outputs of padding tokens are meaningless: keep the first `sum(seq_lens)` rows.
    """
    if forward_mode not in (ForwardMode.EXTEND, ForwardMode.DECODE):
        raise ValueError(f"make_forward_batch builds EXTEND or DECODE batches, got {forward_mode!r}")
    lens = np.asarray(seq_lens, dtype=np.int64)
    slots = np.asarray(recurrent_indices, dtype=np.int64)
    prefix = np.zeros_like(lens) if prefix_lens is None else np.asarray(prefix_lens, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(
            f"seq_lens must be a non-empty 1-D list of token counts, got {list(np.atleast_1d(lens))}"
        )
    if slots.shape != lens.shape or prefix.shape != lens.shape:
        raise ValueError(
            f"seq_lens, recurrent_indices and prefix_lens must have one entry per request: "
            f"got {lens.size}, {slots.size} and {prefix.size}"
        )
    if np.any(lens < 0) or np.any(prefix < 0):
        raise ValueError(f"seq_lens {lens.tolist()} and prefix_lens {prefix.tolist()} must be >= 0")
    if forward_mode == ForwardMode.DECODE and np.any(lens != 1):
        raise ValueError(f"a DECODE batch has exactly one token per request, got seq_lens {lens.tolist()}")

    num_reqs, num_real_tokens = lens.size, int(lens.sum())
    if forward_mode == ForwardMode.DECODE:
        padded_reqs = bucket(num_reqs, min_requests)
        num_tokens = padded_reqs
        padded_lens = np.ones(padded_reqs, np.int64)
    else:
        padded_reqs = bucket(num_reqs + 1, min_requests)
        num_tokens = bucket(num_real_tokens, min_tokens)
        padded_lens = np.zeros(padded_reqs, np.int64)
        padded_lens[:num_reqs] = lens
        padded_lens[num_reqs] = num_tokens - num_real_tokens
    padded_slots = np.full(padded_reqs, DUMMY_SLOT, np.int64)
    padded_slots[:num_reqs] = slots

    positions = np.zeros(num_tokens, np.int64)
    starts = np.cumsum(lens) - lens
    positions[:num_real_tokens] = np.arange(num_real_tokens) - np.repeat(starts - prefix, lens)

    metadata = attn_backend.get_forward_metadata(forward_mode, padded_lens, padded_slots)
    return ForwardBatch(
        forward_mode=forward_mode,
        positions=jnp.asarray(positions, jnp.int32),
        attn_backend=attn_backend.with_forward_metadata(metadata),
    )


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` `[T_real, ...]` padded with zero rows to `[rows, ...]` (the batch's `num_tokens`)."""
    if x.shape[0] > rows:
        raise ValueError(f"cannot pad {x.shape[0]} rows down to {rows}")
    return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def seq_lens_from_cu_seqlens(cu_seqlens: np.ndarray, num_tokens: int) -> np.ndarray:
    """The `[N]` lengths of a packed batch of `num_tokens` tokens given as offsets `i32[N+1]`.

    ValueError naming the offsets unless they are integers starting at 0, non-decreasing and ending at
    `num_tokens`.
    """
    offsets = np.asarray(cu_seqlens)
    if offsets.ndim != 1 or offsets.size < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be integer offsets [N+1] with N >= 1, got {offsets!r}")
    dynamic_validate_cu_seqlens(offsets, num_tokens)
    return np.diff(offsets)
