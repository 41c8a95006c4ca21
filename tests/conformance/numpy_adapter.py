"""A plain numpy implementation of kda-layer.md, for the conformance tests only.

It writes the synthetic dump sets of the tests, and is held to golden/ (transformers' torch layer)
by tests/conformance/test_broken.py, so that its own dumps are not its only oracle; its small
overridable steps (`gate`, `conv`, `forward`) let the tests break it on purpose. Its recurrence is
`kda_spec.truth.packed_delta_rule` run on fp32 inputs, its l2 norm the checker's (`checks.calls.l2norm`).
Token loops throughout: clear, and fast enough at test sizes.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from conformance.adapter import KernelAdapter, LayerAdapter, LayerResult
from conformance.checks.calls import l2norm
from kda_spec.truth import packed_delta_rule


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (kept as float32)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@dataclasses.dataclass
class NumpyCarry:
    conv_state: np.ndarray  # [N, W-1, 3P]: the last W-1 conv inputs of each sequence
    recurrent_state: np.ndarray  # [N, H, D, D]


class NumpyAdapter(LayerAdapter, KernelAdapter):
    """kda-layer.md in numpy; the bf16 run rounds at the precision contract's points
    (docs/bf16-rounding.md)."""

    name = "numpy-reference"

    def __init__(self, config, weights, dtype, kernel="auto", *, options=None):
        super().__init__(config, weights, dtype, kernel, options=options)
        keep_fp32 = {"A_log", "dt_bias"}
        self.w = {
            name: (w if name in keep_fp32 else self.cast(w)).astype(np.float32) for name, w in weights.items()
        }

    def cast(self, x: np.ndarray) -> np.ndarray:
        """The run's activation dtype (bf16 values kept as float32)."""
        return round_bf16(x) if self.dtype == "bf16" else np.asarray(x, np.float32)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.cast(x @ self.w[name].T)

    def heads(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(x.shape[0], self.config.num_heads, self.config.head_dim)

    # Steps a broken test adapter overrides.
    def gate(self, f: np.ndarray) -> np.ndarray:
        """g = -exp(A_log) * softplus(f), per head (step 3); f: [T, H, D] fp32."""
        softplus = np.where(f > 20, f, np.log1p(np.exp(np.minimum(f, 20))))
        return -np.exp(self.w["A_log"].reshape(1, -1, 1)) * softplus

    def conv(self, u: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Causal depthwise conv + silu of one sequence u [t, 3P] after its state [W-1, 3P]."""
        kernel = np.concatenate([self.w[f"{p}_conv1d.weight"][:, 0, :] for p in "qkv"], axis=0)  # [3P, W]
        width = kernel.shape[1]
        padded = np.concatenate([state, u], axis=0)
        y = np.stack([np.sum(padded[t : t + width] * kernel.T, axis=0) for t in range(u.shape[0])])
        return self.cast(y / (1 + np.exp(-y))), padded[-(width - 1) :]  # silu in fp32, one rounding

    def conv_packed(self, u: np.ndarray, cu_seqlens: np.ndarray, states: np.ndarray):
        out, new_states = np.zeros_like(u), np.zeros_like(states)
        for n in range(len(cu_seqlens) - 1):
            lo, hi = cu_seqlens[n], cu_seqlens[n + 1]
            out[lo:hi], new_states[n] = self.conv(u[lo:hi], states[n])
        return out, new_states

    def forward(self, x: np.ndarray, cu_seqlens: np.ndarray, carry: NumpyCarry) -> LayerResult:
        cfg = self.config
        x = self.cast(x)
        qkv = np.concatenate([self.linear(x, f"{p}_proj.weight") for p in "qkv"], axis=1)
        conv_out, conv_state = self.conv_packed(qkv, cu_seqlens, carry.conv_state)
        q, k, v = (self.heads(part) for part in np.split(conv_out, 3, axis=1))
        f = self.heads(self.linear(self.linear(x, "f_a_proj.weight"), "f_b_proj.weight")) + self.heads(
            self.w["dt_bias"][None]
        )
        g = self.gate(f.astype(np.float32)).astype(np.float32)
        beta = 1 / (1 + np.exp(-self.linear(x, "b_proj.weight")))
        o, states = packed_delta_rule(l2norm(q), l2norm(k), v, g, beta, cu_seqlens, carry.recurrent_state)
        o = self.cast(o)
        g_out = self.heads(self.linear(self.linear(x, "g_a_proj.weight"), "g_b_proj.weight"))
        rms = 1 / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
        o_norm = self.cast(o * rms * self.w["o_norm.weight"] * (1 / (1 + np.exp(-g_out))))
        out = self.linear(o_norm.reshape(x.shape[0], -1), "o_proj.weight")
        intermediates = {
            "q_after_conv": q,
            "k_after_conv": k,
            "v_after_conv": v,
            "g": g,
            "beta": beta,
            "g_out": g_out,
            "o_norm": o_norm,
        }
        return LayerResult(out, states, NumpyCarry(conv_state, states), intermediates)

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        if carry is None:
            num_seqs, cfg = len(cu_seqlens) - 1, self.config
            conv = np.zeros((num_seqs, cfg.conv_size - 1, cfg.conv_dim), np.float32)
            if initial_state is None:
                initial_state = np.zeros((num_seqs, cfg.num_heads, cfg.head_dim, cfg.head_dim), np.float32)
            carry = NumpyCarry(conv, np.asarray(initial_state, np.float32))
        return self.forward(hidden_states, np.asarray(cu_seqlens), carry)

    def layer_decode(self, hidden_states, carry):
        num_seqs = hidden_states.shape[0]
        return self.forward(hidden_states, np.arange(num_seqs + 1), carry)

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        o, states = packed_delta_rule(q, k, self.cast(v), g, beta, cu_seqlens, initial_state)
        return self.cast(o), states

    recurrent_kernel = chunk_kernel
