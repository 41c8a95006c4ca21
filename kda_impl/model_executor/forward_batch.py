"""What one forward step runs on: the mode, the token positions and the attention backend with its metadata.

`make_forward_batch` builds an EXTEND or DECODE batch outside `jit`, padding its sizes to buckets so
that a jitted forward compiles once per bucket, not once per set of lengths; `make_dp_forward_batch`
builds one for data-parallel attention, the requests of each data rank padded alike.

Slot contract (`kda_impl.kernels.slots`): each real request has its own slot 1..num_slots of its data
rank's pool, distinct within the batch; padding requests all use the rank's dummy slot 0. Anything else
(an out-of-range, dummy or repeated slot; a float or bool slot or length) is refused with a ValueError.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kda_impl.kernels.slots import DUMMY_SLOT, as_int_array, check_request_slots, is_int
from kda_impl.kernels.validation import dynamic_validate_cu_seqlens
from kda_impl.parallel.mesh import DATA_AXIS

if TYPE_CHECKING:
    from kda_impl.layers.attention.linear.kda_backend import LinearRecurrentAttnBackend

MIN_TOKEN_BUCKET = 64
MIN_REQUEST_BUCKET = 8


class ForwardMode(enum.IntEnum):
    """The kind of step, as in sgl-jax. Which ones the KDA backend serves: `kda_backend.FORWARD_MODES`."""

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
    `forward_mode` and `dp_size` are static aux data.

    With data parallelism (`dp_size` > 1, `make_dp_forward_batch`) every array is the data ranks' arrays
    one after the other, each rank padded to the same sizes; without it, the one rank's arrays.
    """

    forward_mode: ForwardMode
    positions: jax.Array  # i32[T] position of each token in its request (0 for padding tokens)
    attn_backend: LinearRecurrentAttnBackend  # carries forward_metadata (cu_q_lens, recurrent_indices)
    dp_size: int = 1

    @property
    def num_tokens(self) -> int:
        """T, the padded token count (of all data ranks)."""
        return self.positions.shape[0]

    @property
    def batch_size(self) -> int:
        """N, the padded request count (of all data ranks)."""
        return self.attn_backend.forward_metadata.recurrent_indices.shape[0]

    @property
    def tokens_per_rank(self) -> int:
        """The padded token count of one data rank."""
        return self.num_tokens // self.dp_size

    def rank_rows(self, dp_rank: int) -> slice:
        """The rows of data rank `dp_rank`'s tokens in the batch's `[T, ...]` arrays."""
        if not is_int(dp_rank):
            raise ValueError(f"dp_rank must be an int, got {dp_rank!r}")
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not a data rank of this batch (it has {self.dp_size})")
        return slice(dp_rank * self.tokens_per_rank, (dp_rank + 1) * self.tokens_per_rank)

    def request_rows(self, dp_rank: int, seq_lens: Sequence[int]) -> list[np.ndarray]:
        """The rows holding each request of data rank `dp_rank` (whose `seq_lens` built the batch)."""
        ends = self.rank_rows(dp_rank).start + np.cumsum(as_int_array(seq_lens, "seq_lens"))
        return [np.arange(end - n, end) for end, n in zip(ends, seq_lens)]

    def partition_specs(self) -> ForwardBatch:
        """This batch's tree with a `PartitionSpec` per array: every array split over `data`."""
        return jax.tree.map(lambda _: PartitionSpec(DATA_AXIS), self)

    def replace(self, **changes: Any) -> ForwardBatch:
        return dataclasses.replace(self, **changes)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[ForwardMode, int]]:
        return (self.positions, self.attn_backend), (self.forward_mode, self.dp_size)

    @classmethod
    def tree_unflatten(cls, aux: tuple[ForwardMode, int], children: tuple[Any, ...]) -> ForwardBatch:
        forward_mode, dp_size = aux
        return cls(forward_mode, *children, dp_size=dp_size)


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
    num_slots: int,
    prefix_lens: Sequence[int] | None = None,
    min_tokens: int = MIN_TOKEN_BUCKET,
    min_requests: int = MIN_REQUEST_BUCKET,
) -> ForwardBatch:
    """Build a padded EXTEND, DECODE or TARGET_VERIFY batch for N requests (outside `jit`).

    Args:
        attn_backend: the shared backend; the batch gets a copy bound to this batch's metadata.
        forward_mode: EXTEND (prefill / chunked prefill), DECODE (one token per request) or TARGET_VERIFY.
        seq_lens: `[N]` new tokens of each request in this step (each 1 for DECODE; 0 allowed for EXTEND).
        recurrent_indices: `[N]` state-pool slot of each request, from
            `RecurrentStatePool.get_recurrent_indices`: real slots 1..num_slots, all different.
        num_slots: the pool's real slots (per data rank), `pool.num_slots`.
        prefix_lens: `[N]` tokens each request has already processed (for `positions`); zeros if None.
        min_tokens / min_requests: the smallest buckets.

    Lengths and slots are ints (Python ints or integer arrays; floats, even 2.0, and bools are refused).
    A slot outside 1..num_slots, the dummy slot 0 or a slot given to two requests is refused with a
    ValueError naming the slot and the pool size: a real request never shares a slot.

    Bucketing (so a jitted forward compiles once per bucket pair, not per set of lengths):
        - EXTEND and TARGET_VERIFY (draft tokens): the token count T is padded to
          `bucket(T, min_tokens)` and the request count to `bucket(N + 1, min_requests)`. The first
          padding request owns all padding tokens; the others are zero-length. Padding requests use
          the pool's dummy slot 0, so they never read or write a real slot. The caller pads
          `hidden_states` to `batch.num_tokens` rows (`pad_rows`).
        - DECODE: N is padded to `bucket(N, min_requests)` and T = N; each padding request has one
          padding token and the dummy slot (padding rows may repeat the dummy slot, real ones never).
        Outputs of padding tokens are meaningless: keep the first `sum(seq_lens)` rows.
    """
    lens = as_int_array(seq_lens, "seq_lens")
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(
            f"seq_lens must be a non-empty 1-D list of token counts, got {list(np.atleast_1d(lens))}"
        )
    return make_dp_forward_batch(
        attn_backend,
        forward_mode,
        [seq_lens],
        [recurrent_indices],
        num_slots=num_slots,
        prefix_lens=None if prefix_lens is None else [prefix_lens],
        min_tokens=min_tokens,
        min_requests=min_requests,
    )


def make_dp_forward_batch(
    attn_backend: LinearRecurrentAttnBackend,
    forward_mode: ForwardMode,
    seq_lens: Sequence[Sequence[int]],
    recurrent_indices: Sequence[Sequence[int] | np.ndarray],
    *,
    num_slots: int,
    prefix_lens: Sequence[Sequence[int]] | None = None,
    min_tokens: int = MIN_TOKEN_BUCKET,
    min_requests: int = MIN_REQUEST_BUCKET,
) -> ForwardBatch:
    """A batch for data-parallel attention: requests `seq_lens[r]` run on data rank r (outside `jit`).

    One list per data rank of `seq_lens`, `recurrent_indices` (slots 1..num_slots of rank r's share of the
    pool, `RecurrentStatePool.get_recurrent_indices(..., dp_rank=r)`, checked as `make_forward_batch`
    checks them, rank by rank: two ranks may use the same slot number) and `prefix_lens`; a rank may have no
    request. Each rank is padded as `make_forward_batch` pads a batch, all to the same buckets (the
    largest any rank needs), and every array holds the ranks' parts one after the other: rank r's
    hidden states go to rows `batch.rank_rows(r)` of the `[T, hidden]` input (first its real tokens,
    then zero rows), its outputs come back in the same rows.
    """
    if forward_mode not in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        raise ValueError(
            f"make_forward_batch builds EXTEND, DECODE or TARGET_VERIFY batches, got {forward_mode!r}"
        )
    if not is_int(num_slots) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive int (the pool's num_slots), got {num_slots!r}")
    dp = len(seq_lens)
    prefixes = [None] * dp if prefix_lens is None else list(prefix_lens)
    if dp < 1 or len(recurrent_indices) != dp or len(prefixes) != dp:
        raise ValueError(
            f"seq_lens, recurrent_indices and prefix_lens need one list per data rank: got {dp}, "
            f"{len(recurrent_indices)} and {len(prefixes)} lists"
        )
    ranks = []
    for rank, (lens, slots, prefix) in enumerate(zip(seq_lens, recurrent_indices, prefixes)):
        try:
            ranks.append(_rank_requests(forward_mode, lens, slots, prefix, num_slots))
        except ValueError as err:
            raise ValueError(f"data rank {rank}: {err}" if dp > 1 else str(err)) from None
    if forward_mode == ForwardMode.DECODE:
        padded_reqs = max(bucket(lens.size, min_requests) for lens, _, _ in ranks)
        num_tokens = padded_reqs
    else:
        padded_reqs = max(bucket(lens.size + 1, min_requests) for lens, _, _ in ranks)
        num_tokens = max(bucket(int(lens.sum()), min_tokens) for lens, _, _ in ranks)

    positions, metadata = [], []
    for lens, slots, prefix in ranks:
        padded_lens, padded_slots, rank_positions = _pad_rank(
            forward_mode, lens, slots, prefix, padded_reqs, num_tokens
        )
        positions.append(rank_positions)
        metadata.append(
            attn_backend.get_forward_metadata(forward_mode, padded_lens, padded_slots, num_slots=num_slots)
        )
    return ForwardBatch(
        forward_mode=forward_mode,
        positions=jnp.asarray(np.concatenate(positions), jnp.int32),
        attn_backend=attn_backend.with_forward_metadata(
            jax.tree.map(lambda *parts: jnp.concatenate(parts), *metadata)
        ),
        dp_size=dp,
    )


def _rank_requests(
    forward_mode: ForwardMode,
    seq_lens: Sequence[int],
    recurrent_indices: Sequence[int] | np.ndarray,
    prefix_lens: Sequence[int] | None,
    num_slots: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The requests of one data rank as int64 arrays `(seq_lens, slots, prefix_lens)`, validated."""
    lens = as_int_array(seq_lens, "seq_lens")
    slots = as_int_array(recurrent_indices, "recurrent_indices")
    prefix = np.zeros_like(lens) if prefix_lens is None else as_int_array(prefix_lens, "prefix_lens")
    if lens.ndim != 1:
        raise ValueError(f"seq_lens must be a 1-D list of token counts, got {list(np.atleast_1d(lens))}")
    if slots.shape != lens.shape or prefix.shape != lens.shape:
        raise ValueError(
            f"seq_lens, recurrent_indices and prefix_lens must have one entry per request: "
            f"got {lens.size}, {slots.size} and {prefix.size}"
        )
    if np.any(lens < 0) or np.any(prefix < 0):
        raise ValueError(f"seq_lens {lens.tolist()} and prefix_lens {prefix.tolist()} must be >= 0")
    if forward_mode == ForwardMode.DECODE and np.any(lens != 1):
        raise ValueError(f"a DECODE batch has exactly one token per request, got seq_lens {lens.tolist()}")
    check_request_slots(slots, num_slots)
    return lens, slots, prefix


def _pad_rank(
    forward_mode: ForwardMode,
    lens: np.ndarray,  # [N] tokens of each request
    slots: np.ndarray,  # [N]
    prefix: np.ndarray,  # [N]
    padded_reqs: int,
    num_tokens: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's `(seq_lens [padded_reqs], slots [padded_reqs], positions [num_tokens])`, padded."""
    num_reqs, num_real_tokens = lens.size, int(lens.sum())
    if forward_mode == ForwardMode.DECODE:
        padded_lens = np.ones(padded_reqs, np.int64)
    else:
        padded_lens = np.zeros(padded_reqs, np.int64)
        padded_lens[:num_reqs] = lens
        padded_lens[num_reqs] = num_tokens - num_real_tokens
    padded_slots = np.full(padded_reqs, DUMMY_SLOT, np.int64)
    padded_slots[:num_reqs] = slots
    positions = np.zeros(num_tokens, np.int64)
    starts = np.cumsum(lens) - lens
    positions[:num_real_tokens] = np.arange(num_real_tokens) - np.repeat(starts - prefix, lens)
    return padded_lens, padded_slots, positions


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
