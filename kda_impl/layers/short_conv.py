"""Depthwise causal short convolution over a packed batch, with a conv state per sequence.

For channel `c` of a sequence with input `u` (its W-1 previous inputs, the conv state, in front):
`y[t, c] = sum_{j=0..W-1} weight[j, c] * u[t - (W-1) + j, c]`. Tokens only ever see their own
sequence: the inputs before a sequence's first token come from that sequence's state (zeros for a
new sequence), never from the sequence packed before it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kda_impl.kernels.common import sequence_ids


def short_conv_with_state(
    x: jax.Array,  # [T, C] conv inputs of the packed batch
    weight: jax.Array,  # [W, C] taps; weight[W-1] multiplies the current token
    conv_state: jax.Array,  # [N, W-1, C] the last W-1 inputs of each sequence before this batch
    cu_seqlens: jax.Array,  # i32[N+1] token offsets of the N sequences in x
) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise conv of every sequence, and each sequence's new conv state.

    Accumulates in fp32 and rounds once to `x.dtype`. Zero-length sequences keep their state.

    Returns:
        `(y, new_state)`: y `[T, C]` in x's dtype; new_state `[N, W-1, C]` in conv_state's dtype,
        the last W-1 inputs of `[state | own tokens]` of each sequence.
    """
    width, channels = weight.shape
    tokens, num_seqs = x.shape[0], conv_state.shape[0]
    if x.ndim != 2 or x.shape[1] != channels:
        raise ValueError(f"x must be [T, C={channels}] (C from weight {weight.shape}), got {x.shape}")
    if conv_state.shape[1:] != (width - 1, channels):
        raise ValueError(f"conv_state must be [N, W-1={width - 1}, C={channels}], got {conv_state.shape}")
    if cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(
            f"cu_seqlens must be [N+1]={(num_seqs + 1,)} for N={num_seqs} states, got {cu_seqlens.shape}"
        )

    history = width - 1
    # One flat table: the N states (W-1 rows each) followed by the T tokens; every conv input is a row.
    rows = jnp.concatenate([conv_state.reshape(num_seqs * history, channels).astype(x.dtype), x], axis=0)
    token_row0 = num_seqs * history
    cu_seqlens = cu_seqlens.astype(jnp.int32)

    seq = sequence_ids(cu_seqlens, tokens)  # [T]
    t = jnp.arange(tokens, dtype=jnp.int32)
    pos = t - cu_seqlens[seq]  # [T] position inside its sequence
    lag = jnp.arange(history, -1, -1, dtype=jnp.int32)  # [W]: tap j reads lag W-1-j
    from_tokens = pos[:, None] >= lag[None, :]
    window_rows = jnp.where(
        from_tokens,
        token_row0 + t[:, None] - lag[None, :],
        seq[:, None] * history + history + pos[:, None] - lag[None, :],
    )  # [T, W]
    taps = weight.astype(jnp.float32)
    # W is small (4): one gathered [T, C] slab per tap keeps the peak memory at a few copies of x.
    y = sum(rows[window_rows[:, j]].astype(jnp.float32) * taps[j] for j in range(width)).astype(x.dtype)

    new_state = rows[_window_rows(cu_seqlens, cu_seqlens[1:] - cu_seqlens[:-1], history)]
    return y, new_state.astype(conv_state.dtype)  # [N, W-1, C]


def _window_rows(cu_seqlens: jax.Array, consumed: jax.Array, history: int) -> jax.Array:
    """i32[N, W-1]: the rows of the `[N states (W-1 rows each) | T tokens]` table holding sequence n's
    conv state after its first `consumed[n]` tokens: rows consumed_n .. consumed_n + W-2 of its own
    `[state | tokens]` concatenation."""
    num_seqs = consumed.shape[0]
    e = consumed[:, None] + jnp.arange(history, dtype=jnp.int32)[None, :]  # [N, W-1]
    n = jnp.arange(num_seqs, dtype=jnp.int32)[:, None]
    token_row0 = num_seqs * history
    return jnp.where(e < history, n * history + e, token_row0 + cu_seqlens[:-1, None] + e - history)


def conv_states_per_token(
    x: jax.Array,  # [T, C] conv inputs of the packed batch
    conv_state: jax.Array,  # [N, W-1, C] the last W-1 inputs of each sequence before this batch
    cu_seqlens: jax.Array,  # i32[N+1] token offsets of the N sequences in x
    steps: int,
) -> jax.Array:
    """[N, steps, W-1, C] in conv_state's dtype: each sequence's conv state after its first j+1 tokens
    (j < steps; after all of them for a sequence of fewer), what a verify forward keeps for each draft."""
    history, num_seqs = conv_state.shape[1], conv_state.shape[0]
    rows = jnp.concatenate([conv_state.reshape(num_seqs * history, -1).astype(x.dtype), x], axis=0)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    windows = [rows[_window_rows(cu_seqlens, jnp.minimum(lengths, j + 1), history)] for j in range(steps)]
    return jnp.stack(windows, axis=1).astype(conv_state.dtype)
