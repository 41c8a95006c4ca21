"""The plain-JAX KDA kernels (RFC §4.1 `naive.py`): what every platform can run."""

from kda_impl.kernels.naive_chunk import chunk_kda
from kda_impl.kernels.naive_decode import decode_kda_slots
from kda_impl.kernels.naive_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "decode_kda_slots", "fused_recurrent_kda"]
