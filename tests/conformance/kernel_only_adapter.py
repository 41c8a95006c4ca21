"""A kernel-only adapter: the numpy reference's kernels and nothing else, for the conformance tests.

It declares the kernel protocol alone, as a library of KDA kernels without a layer of its own would
(tpu-inference's pure-JAX kernels, tokamax): the suite checks its kernels and skips every other check
when the run is planned (tests/conformance/test_kernel_only.py).
"""

from __future__ import annotations

import numpy as np

from conformance.adapter import KernelAdapter
from kda_spec.truth import packed_delta_rule
from tests.conformance.numpy_adapter import round_bf16


class KernelOnlyAdapter(KernelAdapter):
    """`NumpyAdapter`'s kernels: the float64 recurrence on the inputs as given, v and o in the run dtype."""

    name = "numpy kernels only"

    def cast(self, x: np.ndarray) -> np.ndarray:
        """The run's activation dtype (bf16 values kept as float32)."""
        return round_bf16(x) if self.dtype == "bf16" else np.asarray(x, np.float32)

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        o, states = packed_delta_rule(q, k, self.cast(v), g, beta, cu_seqlens, initial_state)
        return self.cast(o), states

    recurrent_kernel = chunk_kernel
