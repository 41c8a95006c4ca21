"""The plain-JAX KDA kernels, the dispatcher's `naive` choice (RFC §4.1 `naive.py`): what every platform
can run. "naive" names the backend (no Pallas), not the algorithms: `chunk_kda` is the optimised exact
chunked form (`chunk.py`); `fused_recurrent_kda` (`naive_recurrent.py`) is the token recurrence line for
line, the math-first reference the other kernels are tested against; `naive_chunk_kda`
(`naive_chunk.py`) is the chunked form as its equations read, the chunk kernels' reference (float32 or
float64; not dispatched)."""

from kda_impl.kernels.chunk import chunk_kda
from kda_impl.kernels.naive_chunk import naive_chunk_kda
from kda_impl.kernels.naive_decode import decode_kda_slots
from kda_impl.kernels.naive_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "decode_kda_slots", "fused_recurrent_kda", "naive_chunk_kda"]
