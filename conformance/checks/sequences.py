"""Cutting the sequences of a packed batch for prefill→decode and chunked-prefill checks."""

from __future__ import annotations

import numpy as np

# Chunked prefill splits every sequence into up to this many parts (fewer when a sequence is shorter).
CHUNKED_PREFILL_PARTS = 3
# Decode checks run k = 1 and k = 8 tokens, and every token after the first while sequences are this short.
DECODE_STEPS = (1, 8)
DECODE_ALL_MAX_LEN = 65


def offsets(lengths: list[int] | tuple[int, ...]) -> np.ndarray:
    """cu_seqlens of a packed batch of sequences of `lengths`."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def decode_lengths(seq_lens: tuple[int, ...], k: int | None) -> list[int]:
    """Decode steps per sequence: k (None: all but the first token), never the whole sequence."""
    return [n - 1 if k is None else min(k, n - 1) for n in seq_lens]


def split_points(n: int, parts: int) -> list[int]:
    """Boundaries of `parts` nearly equal, non-empty pieces of a sequence of n tokens (n >= parts)."""
    return [round(n * j / parts) for j in range(1, parts)]


def chunked_prefill_pieces(seq_lens: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """For each prefill call, the (start, stop) token range of every sequence, relative to that sequence.

    Every call carries all sequences with at least one token each, so the number of calls is bounded by
    the shortest sequence; a list with a single call means the case cannot be split.
    """
    parts = min(CHUNKED_PREFILL_PARTS, min(seq_lens))
    bounds = [[0, *split_points(n, parts), n] for n in seq_lens]
    return [[(b[j], b[j + 1]) for b in bounds] for j in range(parts)]


def pieces_of(seq_lens: tuple[int, ...], piece_tokens: int) -> list[list[tuple[int, int]]]:
    """`chunked_prefill_pieces`'s form for pieces of a fixed size: each call takes the next `piece_tokens`
    tokens of every sequence (its last call the rest). Every call carries all sequences, so they must need
    the same number of calls; `piece_tokens` >= the longest sequence is one call, the whole prefill."""
    if piece_tokens < 1:
        raise ValueError(f"piece_tokens must be >= 1, got {piece_tokens}")
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens must be non-empty lengths >= 1, got {seq_lens}")
    calls = {-(-n // piece_tokens) for n in seq_lens}
    if len(calls) > 1:
        raise ValueError(
            f"seq_lens {seq_lens} need {sorted(calls)} calls of piece_tokens={piece_tokens}: every call "
            "carries a piece of each sequence, so they must need the same number"
        )
    starts = range(0, max(seq_lens), piece_tokens)
    return [[(lo, min(lo + piece_tokens, n)) for n in seq_lens] for lo in starts]


def gather(x: np.ndarray, cu_seqlens: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """The rows `ranges[i]` (relative to sequence i) of every sequence of a packed batch, packed again."""
    return np.concatenate([x[cu_seqlens[i] + lo : cu_seqlens[i] + hi] for i, (lo, hi) in enumerate(ranges)])


def rows(cu_seqlens: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """The absolute token indices that `gather` with the same ranges picks, in the same order."""
    return np.concatenate(
        [np.arange(cu_seqlens[i] + lo, cu_seqlens[i] + hi) for i, (lo, hi) in enumerate(ranges)]
    )
