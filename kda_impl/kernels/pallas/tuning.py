"""Block sizes of the Pallas KDA kernels, in one place so that tuning never touches the kernels.

Every block spans whole head dimensions (K, V), so the TPU tiling rule — the last two block dims are
multiples of (8, 128) or equal the array's — holds for any head size; K = V = 128 is the size the
kernels are laid out for.
"""

from __future__ import annotations

CHUNK_SIZE = 64  # tokens per chunk of `chunk_kda`, as fla
SUB_BLOCK = 16  # rows of the exact element-wise decay blocks in a chunk (see pallas/chunk.py); a power of 2
RECURRENT_TOKENS_PER_STEP = 16  # tokens one grid step of `fused_recurrent_kda` loops over
DECODE_STATE_BYTES_PER_STEP = 512 * 1024  # fp32 state bytes one decode grid step reads (and writes)


def decode_heads_per_step(heads: int, key_dim: int, value_dim: int) -> int:
    """Heads one decode grid step updates: the largest divisor of H whose states fit the byte budget."""
    per_head = key_dim * value_dim * 4
    fitting = [
        h for h in range(1, heads + 1) if heads % h == 0 and h * per_head <= DECODE_STATE_BYTES_PER_STEP
    ]
    return max(fitting, default=1)
