"""The plain-JAX KDA kernels, the dispatcher's `naive` choice (RFC §4.1 `naive.py`): what every platform
can run. "naive" names the backend (no Pallas), not the algorithms: `chunk_kda` is the optimised exact
chunked form (`chunk.py`); `fused_recurrent_kda` (`recurrent.py`) is the token recurrence line for
line, the math-first reference the other kernels are tested against; `reference_chunk_kda`
(`reference_chunk.py`) is the chunked form as its equations read, the chunk kernels' reference (float32 or
float64; not dispatched)."""

from kda_impl.kernels.chunk import chunk_kda
from kda_impl.kernels.decode import decode_kda_slots
from kda_impl.kernels.recurrent import fused_recurrent_kda
from kda_impl.kernels.reference_chunk import reference_chunk_kda

__all__ = ["chunk_kda", "decode_kda_slots", "fused_recurrent_kda", "reference_chunk_kda"]
