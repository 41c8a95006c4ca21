"""Pieces shared by every KDA kernel and the layer: the one softplus, gate and l2norm of kda_impl, the fp32
upcast, the log-decay floor, the kernels' inputs (`KdaInputs`, `PackedInputs`) and the packed-batch
bookkeeping (sequence offsets, the chunk layout)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
LOG_DECAY_FLOOR = -1e4  # exp of it, and of any sum holding it, is exactly 0 in fp32


def softplus(z: jax.Array) -> jax.Array:
    """torch's softplus: `z` above 20, else `log1p(exp(z))`.

    `log1p` keeps full relative accuracy for very negative z, where `log(1 + exp(z))` (transformers'
    port) rounds `1 + exp(z)` first: 0.9 % error at z = -12, 6 % at -16, exactly 0 below -16.6. The
    `min` only keeps the untaken branch finite; above 20 the result is z itself, not a clipped 20.
    """
    return jnp.where(z > SOFTPLUS_THRESHOLD, z, jnp.log1p(jnp.exp(jnp.minimum(z, SOFTPLUS_THRESHOLD))))


def kda_gate(
    raw: jax.Array,  # [..., K] the gate projection before activation
    a_log: jax.Array,  # broadcastable to raw: A_log of each head
    dt_bias: jax.Array,  # broadcastable to raw
    lower_bound: float | None = None,
) -> jax.Array:
    """The KDA log decay in fp32: Kimi-Linear's `g = -exp(A_log) * softplus(raw + dt_bias)`, or with
    `lower_bound=L` the lower-bound ("safe") gate `g = L * sigmoid(exp(A_log) * (raw + dt_bias))`."""
    raw, a_log, dt_bias = (jnp.asarray(x, jnp.float32) for x in (raw, a_log, dt_bias))
    if lower_bound is not None:
        return jnp.float32(lower_bound) * jax.nn.sigmoid(jnp.exp(a_log) * (raw + dt_bias))
    return -jnp.exp(a_log) * softplus(raw + dt_bias)


def finite_log_decay(g: jax.Array) -> jax.Array:
    """`g` with every value below `LOG_DECAY_FLOOR` (-inf included) raised to it; NaN stays NaN.

    A full reset, g = -inf, makes the chunked form's 0/1-mask matmuls compute `0 * -inf = NaN`. Every
    decay exponent there is a sum of g over a segment (g <= 0, see `chunk.py`), so a segment holding a
    floored value sums to <= -1e4, whose exp is exactly 0 in fp32 (as exp(-inf) is, and exp(g) of any
    g < -104): the result is unchanged for every g <= 0, and finite where -inf would give NaN.
    """
    return jnp.maximum(g, LOG_DECAY_FLOOR)


def l2norm(x: jax.Array) -> jax.Array:
    """`x / sqrt(sum(x*x) + 1e-6)` over the last axis, in fp32 (fla's and HF's l2norm)."""
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_inputs(
    q: jax.Array,  # [B, T, H, K]
    k: jax.Array,  # [B, T, H, K]
    v: jax.Array,  # [B, T, H, V]
    g: jax.Array,  # [B, T, H, K]
    beta: jax.Array,  # [B, T, H]
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, float]:
    """Upcast to fp32 once, l2-normalise q and k if asked, resolve the default scale K**-0.5."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta, float(scale)


def sequence_ids(cu_seqlens: jax.Array, tokens: int) -> jax.Array:
    """i32[T]: the sequence each packed token belongs to (zero-length sequences own no token)."""
    positions = jnp.arange(tokens, dtype=cu_seqlens.dtype)
    return jnp.searchsorted(cu_seqlens[1:], positions, side="right").astype(jnp.int32)


def sequence_offsets(cu_seqlens: jax.Array | None, num_seqs: int, tokens: int) -> jax.Array:
    """i32[N + 1]: `cu_seqlens`, or without them the offsets of N rows of equal length that fill the
    `tokens` packed tokens (a batch of N rows of T tokens, flattened)."""
    if cu_seqlens is None:
        return jnp.arange(num_seqs + 1, dtype=jnp.int32) * (tokens // num_seqs)
    return jnp.asarray(cu_seqlens, jnp.int32)


class KdaInputs(NamedTuple):
    """The per-token arrays of one KDA call; `...` are its token axes: `[B, T]` as a caller gives them,
    `[T]` packed (`PackedInputs`), `[B]` at decode (one token per request)."""

    q: jax.Array  # [..., H, K] queries
    k: jax.Array  # [..., H, K] keys
    v: jax.Array  # [..., H, V] values
    g: jax.Array  # [..., H, K] per-channel log decay (<= 0), or the raw gate with the in-kernel gate
    beta: jax.Array  # [..., H] write strengths

    def map(self, fn: Callable[[jax.Array], jax.Array]) -> KdaInputs:
        """`fn` applied to each of the five arrays."""
        return KdaInputs(*(fn(x) for x in self))

    def scaled(self, scale: float) -> KdaInputs:
        """The same inputs with q multiplied by `scale`."""
        return self._replace(q=self.q * scale)


class PackedInputs(NamedTuple):
    """What a prefill kernel runs on: the packed batch `entry.fla_entry` prepares (fp32, q unscaled and
    l2-normalised if asked), its initial states and its sequence offsets."""

    inputs: KdaInputs  # [T, H, ...]: the B rows of the call flattened into one packed batch
    init: jax.Array  # [N, H, K, V] fp32
    cu_seqlens: jax.Array | None  # i32[N + 1], or None: N rows of equal length

    def offsets(self) -> jax.Array:
        """i32[N + 1]: `cu_seqlens`, or the offsets of the N rows of equal length (`sequence_offsets`)."""
        return sequence_offsets(self.cu_seqlens, self.init.shape[0], self.inputs.q.shape[0])


def initial_or_zeros(initial_state: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """The fp32 initial states [N, H, K, V], zeros when none are given."""
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    return jnp.asarray(initial_state, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk of a packed batch comes from.

    token:    i32[NC, C] packed token index of each chunk row (0 where padded)
    valid:    bool[NC, C] whether that row is a real token
    seq:      i32[NC] sequence of each chunk (chunks past the last one repeat N-1, all rows invalid)
    is_first: bool[NC] the chunk starts its sequence
    slot:     i32[T] chunk of each packed token; row: i32[T] its row in that chunk
    last:     i32[N] last chunk of each sequence; nonempty: bool[N]
    """

    token: jax.Array
    valid: jax.Array
    seq: jax.Array
    is_first: jax.Array
    slot: jax.Array
    row: jax.Array
    last: jax.Array
    nonempty: jax.Array


def chunk_layout(cu_seqlens: jax.Array, tokens: int, chunk_size: int) -> ChunkLayout:
    """Cut every sequence of the packed batch into its own chunks; static size (T + N(C-1)) // C."""
    num_seqs = cu_seqlens.shape[0] - 1
    num_chunks = (tokens + num_seqs * (chunk_size - 1)) // chunk_size
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
    chunk_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(chunks_per_seq)]).astype(jnp.int32)
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    owner = jnp.searchsorted(chunk_offsets[1:], chunk, side="right").astype(jnp.int32)
    in_use = owner < num_seqs
    seq = jnp.minimum(owner, num_seqs - 1)
    local = chunk - chunk_offsets[seq]
    token = cu_seqlens[seq][:, None] + local[:, None] * chunk_size + jnp.arange(chunk_size)[None, :]
    valid = in_use[:, None] & (token < cu_seqlens[seq + 1][:, None])
    token_seq = sequence_ids(cu_seqlens, tokens)
    offset_in_seq = jnp.arange(tokens, dtype=jnp.int32) - cu_seqlens[token_seq]
    return ChunkLayout(
        token=jnp.where(valid, token, 0),
        valid=valid,
        seq=seq,
        is_first=in_use & (local == 0),
        slot=chunk_offsets[token_seq] + offset_in_seq // chunk_size,
        row=offset_in_seq % chunk_size,
        last=jnp.maximum(chunk_offsets[1:] - 1, 0),
        nonempty=lengths > 0,
    )
