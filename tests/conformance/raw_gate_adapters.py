"""Seeded defects of the kernels' raw-gate form (`RawGateKernelAdapter`), on the built-in adapter: each
computes the gate from the raw gate wrongly, the kernels themselves untouched."""

from __future__ import annotations

import numpy as np

from conformance.adapters.kda_impl_adapter import KDAImplAdapter


class RawGateWithoutDtBias(KDAImplAdapter):
    """kda_impl whose raw-gate kernels drop `dt_bias` (fla's `dt_bias=None`: zeros)."""

    name = "kda_impl, raw gate without dt_bias"

    def chunk_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        zeros = np.zeros_like(dt_bias)
        return super().chunk_kernel_raw_gate(
            q, k, v, g_raw, beta, a_log, zeros, lower_bound, cu_seqlens, initial_state
        )

    def recurrent_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        zeros = np.zeros_like(dt_bias)
        return super().recurrent_kernel_raw_gate(
            q, k, v, g_raw, beta, a_log, zeros, lower_bound, cu_seqlens, initial_state
        )


class RawGateSoftplusEverywhere(KDAImplAdapter):
    """kda_impl whose raw-gate kernels ignore the lower bound L: Kimi-Linear's softplus gate in every
    family (right on a Kimi-Linear set, wrong on a lower-bound one)."""

    name = "kda_impl, raw gate always softplus"

    def chunk_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        return super().chunk_kernel_raw_gate(
            q, k, v, g_raw, beta, a_log, dt_bias, None, cu_seqlens, initial_state
        )

    def recurrent_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        return super().recurrent_kernel_raw_gate(
            q, k, v, g_raw, beta, a_log, dt_bias, None, cu_seqlens, initial_state
        )
