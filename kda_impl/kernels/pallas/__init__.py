"""The Pallas KDA kernels (RFC §1.4, §4.2): native on TPU, interpret mode elsewhere.

Same names and signatures as the plain-JAX kernels of `kda_impl.kernels.naive` (fla's options of
`kda_impl.kernels.options` included), plus `interpret` (default: interpret unless the backend is TPU).
`chunk_kda` computes `use_gate_in_kernel`'s gate in the kernel; `decode_kda_slots` steps a v-first pool
(`state_v_first`) in its own layout. Their references: `naive.reference_chunk_kda` (the chunk form),
`naive.fused_recurrent_kda` (the token recurrence), `naive.decode_kda_slots`.
"""

from kda_impl.kernels.pallas.chunk import chunk_kda
from kda_impl.kernels.pallas.decode import decode_kda_slots
from kda_impl.kernels.pallas.recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "decode_kda_slots", "fused_recurrent_kda"]
