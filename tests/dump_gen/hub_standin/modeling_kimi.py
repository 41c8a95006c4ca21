"""Stand-in for the hub's `modeling_kimi.py` (revision 6e163f3), for the CPU tests of the hf-hub reference.

It has the hub file's shape where the generator touches it: a relative import of its configuration, a
module-level `fused_kda_gate` called with fla 0.4.0's signature (so, unpatched, it fails on fla's current
gate as the hub file does), module-level `chunk_kda` / `fused_recurrent_kda` called with keywords, the
kernel picked by length (fused_recurrent for 64 tokens or fewer), `cu_seqlens` as a keyword, and a
`KimiDynamicCache` with `conv_states` / `recurrent_states`. The Triton pieces are replaced by torch ones
that run on a CPU: the kernels by fla-core's torch references, the conv and the gated norm by plain torch.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from fla.ops.kda.gate import fused_kda_gate
from torch import nn

from dump_gen.kernels import NaiveKernels

from .configuration_kimi import KimiLinearConfig


def _spans(cu_seqlens: torch.Tensor | None, tokens: int) -> list[tuple[int, int]]:
    bounds = [0, tokens] if cu_seqlens is None else cu_seqlens.tolist()
    return list(itertools.pairwise(bounds))


def _kernel(path, q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    assert use_qk_l2norm_in_kernel
    spans = _spans(cu_seqlens, q.shape[1])
    result = NaiveKernels().run(
        path, q, k, v, g, beta, spans=spans, packed=cu_seqlens is not None, initial_state=initial_state
    )
    return result.o, result.final_state if output_final_state else None


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    args = (initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return _kernel("chunk", q, k, v, g, beta, *args)


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    args = (initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return _kernel("fused_recurrent", q, k, v, g, beta, *args)


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv + silu over [B, T, C], each sequence of cu_seqlens on its own."""

    def __init__(self, hidden_size: int, kernel_size: int, activation: str = "silu"):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False)
        assert activation == "silu"

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):
        width = self.kernel_size[0]
        outputs, states = [], []
        for index, (start, end) in enumerate(_spans(cu_seqlens, x.shape[1])):
            seq = x[0, start:end].transpose(0, 1)  # [C, T]
            before = seq.new_zeros(seq.shape[0], width) if cache is None else cache[index]
            full = torch.cat([before, seq], dim=-1)
            outputs.append(F.conv1d(full[None], self.weight, groups=self.groups)[0, :, -(end - start) :])
            states.append(full[:, -width:])
        y = F.silu(torch.cat(outputs, dim=-1).transpose(0, 1)[None])
        return y, torch.stack(states) if output_final_state else None


class FusedRMSNormGated(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "sigmoid"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x, g):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(g.float())).to(x.dtype)


class KimiDynamicCache:
    def __init__(self, config: KimiLinearConfig):
        self.conv_states = [None] * config.num_hidden_layers
        self.recurrent_states = [None] * config.num_hidden_layers


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_idx: int):
        super().__init__()
        self.mode = "chunk"
        self.layer_idx = layer_idx
        self.head_dim = config.linear_attn_config["head_dim"]
        self.num_heads = config.linear_attn_config["num_heads"]
        width = config.linear_attn_config["short_conv_kernel_size"]
        proj = self.head_dim * self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d = ShortConvolution(proj, width)
        self.k_conv1d = ShortConvolution(proj, width)
        self.v_conv1d = ShortConvolution(proj, width)
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(proj))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.o_norm = FusedRMSNormGated(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def forward(self, hidden_states, attention_mask=None, cache_params=None, **kwargs):
        q_len = hidden_states.shape[1]
        mode = "fused_recurrent" if q_len <= 64 else self.mode
        cu_seqlens = kwargs.get("cu_seqlens")
        conv_q, conv_k, conv_v = None, None, None
        recurrent_state = None
        if cache_params is not None:
            if cache_params.conv_states[self.layer_idx] is not None:
                conv_q, conv_k, conv_v = cache_params.conv_states[self.layer_idx]
            recurrent_state = cache_params.recurrent_states[self.layer_idx]
        use_cache = cache_params is not None
        q, conv_q = self.q_conv1d(self.q_proj(hidden_states), conv_q, use_cache, cu_seqlens)
        k, conv_k = self.k_conv1d(self.k_proj(hidden_states), conv_k, use_cache, cu_seqlens)
        v, conv_v = self.v_conv1d(self.v_proj(hidden_states), conv_v, use_cache, cu_seqlens)
        g = self.f_b_proj(self.f_a_proj(hidden_states))
        g = fused_kda_gate(g, self.A_log, self.head_dim, g_bias=self.dt_bias)
        beta = self.b_proj(hidden_states).float().sigmoid()
        q, k, v = (x.unflatten(-1, (-1, self.head_dim)) for x in (q, k, v))
        kernel = chunk_kda if mode == "chunk" else fused_recurrent_kda
        o, recurrent_state = kernel(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )
        if cache_params is not None:
            cache_params.recurrent_states[self.layer_idx] = recurrent_state
            cache_params.conv_states[self.layer_idx] = (conv_q, conv_k, conv_v)
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).unflatten(-1, (-1, self.head_dim))
        o = self.o_norm(o, gate)
        return self.o_proj(o.flatten(-2))
