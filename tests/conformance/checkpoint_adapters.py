"""A seeded defect of the chunk kernel's checkpoints (`CheckpointKernelAdapter`), on the built-in adapter:
its kernels untouched, its checkpoints read one chunk late."""

from __future__ import annotations

import numpy as np

from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from kda_spec.truth import chunk_starts


class CheckpointOneChunkLate(KDAImplAdapter):
    """kda_impl whose checkpoint of each chunk is the state at its end, not at its start: the next chunk's
    checkpoint, and a sequence's final state for its last chunk (an index off by one into fla's `h`)."""

    name = "kda_impl, checkpoints one chunk late"

    def chunk_kernel_checkpoints(self, q, k, v, g, beta, cu_seqlens, initial_state, chunk_size):
        h = super().chunk_kernel_checkpoints(q, k, v, g, beta, cu_seqlens, initial_state, chunk_size)
        _, final = self.chunk_kernel(q, k, v, g, beta, cu_seqlens, initial_state)
        chunks = chunk_starts(np.diff(cu_seqlens).tolist(), chunk_size)
        late = np.empty_like(h)
        for row, (sequence, _) in enumerate(chunks):
            last = row + 1 == len(chunks) or chunks[row + 1][0] != sequence
            late[row] = final[sequence] if last else h[row + 1]
        return late
