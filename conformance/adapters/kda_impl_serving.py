"""The built-in adapter's serving path: kda_impl's own pool driven as its scheduler drives it.

One `RecurrentStatePool` of S slots (`serving_open`), the adapter's jitted layer forward
(`KimiDeltaAttention` → `RadixLinearAttention` → the adapter's `backend_class`), and
`make_forward_batch` for each scheduled EXTEND, DECODE or TARGET_VERIFY batch, padded to its buckets as
the engine pads one; the suite's padding rows fill the batch's padding rows (the dummy slot 0). Nothing
else beside it: the slots are the pool's own, a new request's zero states are the ones its `alloc` gives,
a copy is the pool's `copy_slots`, a load its `load_slot`, an accept its `accept_drafts` (each jitted
with the pool's buffers donated), and a verify runs with draft buffers of a power of two >= its drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import (
    MIN_TOKEN_BUCKET,
    ForwardBatch,
    ForwardMode,
    bucket,
    make_forward_batch,
)
from kda_spec.config import KDAConfig

SERVING_MODES = {
    "extend": ForwardMode.EXTEND,
    "decode": ForwardMode.DECODE,
    "verify": ForwardMode.TARGET_VERIFY,
}
MIN_DRAFT_TOKENS = 4  # the smallest draft buffers a verify opens (one compilation per power of two)
# The smallest request bucket of every batch the adapter builds, its layer calls' and its serving
# forwards': the fixed scenarios' largest batch (8 requests and the padding one) fits, so that a layer
# call and a scheduled batch of one mode and token bucket are one compiled program.
REQUEST_BUCKET = 16


class KDAImplServing:
    """One open pool and the forward that runs scheduled batches on it."""

    def __init__(
        self,
        config: KDAConfig,
        layer_idx: int,
        run_dtype: Any,
        backend: KDAAttnBackend,
        forward: Callable[..., tuple[Any, ...]],
        pool: RecurrentStatePool,
        token_bucket: Callable[[int], int],
    ):
        self.config, self.layer_idx, self.run_dtype = config, layer_idx, run_dtype
        self.backend, self.forward, self.pool = backend, forward, pool
        self.token_bucket = token_bucket
        self._host: tuple[np.ndarray, np.ndarray] | None = None  # the pool's buffers on the host

    def alloc(self) -> int:
        self._host = None
        return int(self.pool.alloc(1)[0])

    def free(self, slot: int) -> None:
        self.pool.free([slot])

    def run(
        self,
        mode: str,
        hidden_states: np.ndarray,  # [T, hidden] float32: the requests' tokens, then the padding rows
        seq_lens: np.ndarray,  # [N]
        slots: np.ndarray,  # [N]
        prefix_lens: np.ndarray,  # [N]
        padding_rows: int,
    ) -> np.ndarray:
        """out [T, hidden] float32 of one scheduled batch; the pool keeps the new states."""
        if mode not in SERVING_MODES:
            raise ValueError(f"mode must be one of {sorted(SERVING_MODES)}, got {mode!r}")
        forward_mode = SERVING_MODES[mode]
        real, rows = int(np.sum(seq_lens)), hidden_states.shape[0]
        if rows != real + padding_rows:
            raise ValueError(
                f"hidden_states has {rows} rows; the batch has {real} tokens and {padding_rows} padding rows"
            )
        if forward_mode == ForwardMode.TARGET_VERIFY and self.pool.draft_tokens < int(np.max(seq_lens)):
            self._host = None
            self.pool = self.pool.with_draft_tokens(bucket(int(np.max(seq_lens)), MIN_DRAFT_TOKENS))
        batch = self.batch(forward_mode, seq_lens, slots, prefix_lens, rows, padding_rows)
        x = np.zeros((batch.num_tokens, self.config.hidden_size), np.float32)
        x[:rows] = hidden_states  # DECODE: the padding requests' one token each; EXTEND: padding tokens
        self._host = None
        try:
            out, self.pool, _ = self.forward(x.astype(self.run_dtype), batch, self.pool)
        except BaseException:
            self.pool = None  # its buffers were donated to the failed call
            raise
        return np.asarray(out)[:rows].astype(np.float32)  # sliced on the host: no compile per row count

    def batch(
        self,
        forward_mode: ForwardMode,
        seq_lens: np.ndarray,  # [N]
        slots: np.ndarray,  # [N]
        prefix_lens: np.ndarray,  # [N]
        rows: int,
        padding_rows: int,
    ) -> ForwardBatch:
        """The padded batch of N requests and `padding_rows` (`rows` in all), as the engine builds it."""
        min_requests = bucket(len(seq_lens) + padding_rows + 1, REQUEST_BUCKET)
        return make_forward_batch(
            self.backend,
            forward_mode,
            seq_lens,
            self.pool.get_recurrent_indices(slots),
            num_slots=self.pool.num_slots,
            prefix_lens=prefix_lens,
            min_tokens=max(self.token_bucket(rows), MIN_TOKEN_BUCKET),
            min_requests=min_requests,
        )

    def copy(self, src: int, dst: int) -> None:
        self._host = None
        self.pool = self.pool.copy_slots([src], [dst])

    def load(self, slot: int, recurrent: np.ndarray, conv: np.ndarray) -> None:
        """`slot`'s states from recurrent [H, D, D] and conv [W-1, 3P] (float32, cast to the pool's)."""
        self._host = None
        conv = np.asarray(conv).reshape(1, self.config.conv_size - 1, 3, -1)
        self.pool = self.pool.load_slot(slot, np.asarray(recurrent)[None], conv)

    def accept(self, slot: int, accepted: int) -> None:
        self._host = None
        self.pool = self.pool.accept_drafts([slot], [accepted])

    def state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(recurrent [H, D, D], conv [W-1, 3P]) of `slot`, float32."""
        if self._host is None:
            recurrent, conv = self.pool.get_linear_recurrent_layer_cache(self.layer_idx)
            self._host = (np.asarray(recurrent), np.asarray(conv).astype(np.float32))
        row = int(self.pool.rows([slot])[0])
        recurrent, conv = self._host
        return recurrent[row].astype(np.float32), conv[row].reshape(self.config.conv_size - 1, -1)
