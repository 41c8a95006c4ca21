"""Causality: what a causal kernel's results before a position P may not depend on (fla #1240 and #1242: a
safe-gate path whose chunk anchor was a later token, so that a gate at t >= P moved the outputs and
gradients at positions < P).

For each split position P of a case (`split_positions`: on a 64-token chunk boundary and off one), the
inputs from P on are changed (`changed_from`; the layer's hidden states, `hidden_states_changed_from`) and
the kernel (the layer) run again:

- its output at the positions before P must be the same to the bit (rows before P read only rows before
  P; a masked later row enters as an exact zero);
- with every cotangent from P on zero (`cotangents_before`: do at positions >= P, and dht of every
  sequence that reaches P), its gradients at the positions before P must be the same to the bit, and
  those at P and after exactly zero: the loss no longer depends on them. The layer's are judged by its
  input's gradient, the one with positions (`layer_gradient_breaks`).

The checks compare masks: 1 where a bit changed (or a gradient from P on is not zero), against zeros.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# The kernels' chunk (fla's 64; kda_impl's 32 divides it): one split on its boundary, one inside a chunk.
CHUNK_TOKENS = 64
OFF_BOUNDARY = 17


def split_positions(tokens: int) -> list[int]:
    """The positions P a case of `tokens` packed tokens is split at: the chunk boundary nearest the middle
    (if one lies strictly inside), and a position `OFF_BOUNDARY` tokens into the chunk after it (or the
    middle, for a case shorter than a chunk); none for a case of one token."""
    on = CHUNK_TOKENS * round(tokens / 2 / CHUNK_TOKENS)
    off = on + OFF_BOUNDARY if 0 < on + OFF_BOUNDARY < tokens else tokens // 2
    return sorted({p for p in (on, off) if 0 < p < tokens})


def changed_from(arguments: Mapping[str, Any], position: int) -> dict[str, Any]:
    """A chunk kernel call's `arguments` (`calls.kernel_arguments`) with every per-token input from
    `position` on changed, still valid: q and k negated (unit norm kept), v moved, the decay g stronger
    (4g - 1 <= -1), beta mirrored (1 - beta)."""
    changed = dict(arguments)
    after = slice(position, None)
    for name, change in (
        ("q", lambda x: -x),
        ("k", lambda x: -x),
        ("v", lambda x: np.float32(-1.5) * x + np.float32(0.25)),
        ("g", lambda x: np.float32(4) * x - np.float32(1)),
        ("beta", lambda x: np.float32(1) - x),
    ):
        array = np.array(arguments[name], np.float32)
        array[after] = change(array[after])
        changed[name] = array
    return changed


def hidden_states_changed_from(hidden_states: np.ndarray, position: int) -> np.ndarray:
    """`hidden_states` [T, hidden] with every row from `position` on replaced by another valid row:
    -1.5 x + 0.1 (its l2 norm and direction both moved)."""
    changed = np.array(hidden_states, np.float32)
    changed[position:] = np.float32(-1.5) * changed[position:] + np.float32(0.1)
    return changed


def cotangents_before(
    do: np.ndarray,  # [T, ...] the per-token cotangent: a kernel's do [T, H, D], the layer's dout [T, hidden]
    dht: np.ndarray,  # [N, H, D, D]
    cu_seqlens: np.ndarray,  # i32[N + 1]
    position: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The cotangents with every one from `position` on zero: do at the positions >= `position`, dht of
    each sequence that ends after it (its final state depends on them)."""
    do, dht = np.array(do, np.float32), np.array(dht, np.float32)
    do[position:] = 0
    dht[np.asarray(cu_seqlens)[1:] > position] = 0
    return do, dht


def changed_bits(before: np.ndarray, after: np.ndarray, position: int) -> np.ndarray:
    """1.0 where a row of `after` before `position` differs from `before` in its bits (NaN's included),
    float32 of `before`'s shape (0 from `position` on)."""
    changed = np.zeros(np.shape(before), np.float32)
    rows_before = np.asarray(before)[:position].view(np.uint32) != np.asarray(after)[:position].view(
        np.uint32
    )
    changed[:position] = rows_before
    return changed


def gradient_breaks(
    before: Mapping[str, np.ndarray],  # the gradients by name, dq ... dbeta [T, H, ...]
    after: Mapping[str, np.ndarray],
    position: int,
    names: tuple[str, ...],
) -> np.ndarray:
    """[T, H, D] float32: 1.0 where a gradient of `names` before `position` changed its bits between
    `before` and `after`, or one from `position` on is not zero in `after` (dbeta, [T, H], counts for
    every channel of its head)."""
    breaks = None
    for name in names:
        changed = changed_bits(before[name], after[name], position)
        changed[position:] = np.asarray(after[name])[position:] != 0
        if changed.ndim == 2:  # dbeta [T, H]
            changed = changed[..., None]
        breaks = changed if breaks is None else np.maximum(breaks, changed)
    return breaks


def layer_gradient_breaks(
    before: Mapping[str, np.ndarray],  # a layer vjp's gradients by check result (`dx` [T, hidden], ...)
    after: Mapping[str, np.ndarray],
    position: int,
) -> np.ndarray:
    """[T, hidden] float32: 1.0 where the layer input's gradient `dx` before `position` changed its bits
    between `before` and `after`, or where it is not zero from `position` on in `after`."""
    return gradient_breaks(before, after, position, ("dx",))
