"""The two KDA kernel paths, run on a reference's own q, k, v, g, beta: the kernel-level keys of a dump.

On a GPU: fla's Triton `chunk_kda` and `fused_recurrent_kda`, the packed batch in one call with
`cu_seqlens` (the production kernels). On a CPU: fla-core's torch references `naive_chunk_kda` and
`naive_recurrent_kda`, one sequence at a time since they have no varlen, with q and k L2-normalised in
fp32 first, as the fast kernels do inside (`use_qk_l2norm_in_kernel=True`).

`naive_chunk_kda_call` is fla's `chunk_kda` call, as the hub layer makes it, computed the CPU way: the
hf-hub reference's chunk kernel on a CPU, where fla's Triton one cannot run.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol

import torch
import torch.nn.functional as F

from kda_spec.config import KDAConfig

PATHS = ("chunk", "fused_recurrent")
CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


@dataclasses.dataclass
class KernelResult:
    o: torch.Tensor  # [1, T, H, D], v's dtype
    final_state: torch.Tensor  # [N, H, D, D] float32


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """What one call of a kernel path is fed: a packed batch of N sequences."""

    q: torch.Tensor  # [1, T, H, D], before the L2 norm (after it with `normalized`)
    k: torch.Tensor  # [1, T, H, D], before the L2 norm (after it with `normalized`)
    v: torch.Tensor  # [1, T, H, D]
    g: torch.Tensor  # [1, T, H, D] log-space decay
    beta: torch.Tensor  # [1, T, H]
    spans: list[tuple[int, int]]  # [start, end) of each of the N sequences
    packed: bool  # hand the kernel cu_seqlens (the varlen cases)
    initial_state: torch.Tensor | None  # [N, H, D, D] float32
    normalized: bool = False  # q and k are L2-normalised already: the kernel takes them as they are


class KernelBackend(Protocol):
    name: str
    VJP_PATH: str  # the path whose backward gives the reference's kernel gradients (dump_gen.gradients)

    def run(self, path: str, call: KernelCall) -> KernelResult: ...


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """`x / sqrt(sum(x*x) + 1e-6)` over the last axis, in fp32, as fla's kernels normalise q and k."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


class NaiveKernels:
    """fla-core's torch references, one sequence at a time (CPU)."""

    name = "fla.ops.kda.naive (naive_chunk_kda, naive_recurrent_kda)"
    # The path whose backward (torch autograd) gives the reference's gradients: the token recurrence.
    # naive_chunk_kda exponentiates every in-chunk decay difference g_i - g_j before masking those above
    # the diagonal: where they overflow (golden's mini weights, 41 tokens) its forward selects 0, but its
    # backward multiplies the inf by a zero cotangent: NaN gradients (as transformers' before PR #48455).
    VJP_PATH = "fused_recurrent"
    VJP_NAME = "fla.ops.kda.naive.naive_recurrent_kda"

    def run(self, path: str, call: KernelCall) -> KernelResult:
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

        outputs, states = [], []
        for index, (start, end) in enumerate(call.spans):
            rows = slice(start, end)
            q, k = (x[:, rows] if call.normalized else l2norm(x[:, rows]) for x in (call.q, call.k))
            args = [q, k, call.v[:, rows], call.g[:, rows]]
            seq_beta = call.beta[:, rows]
            state = None if call.initial_state is None else call.initial_state[index : index + 1]
            if path == "chunk":
                # naive_chunk_kda takes whole chunks: pad the tail with q = k = v = g = beta = 0, which
                # leaves the state exactly as it was, and cut the padded outputs off.
                pad = -(end - start) % CHUNK_SIZE
                args = [F.pad(x, (0, 0, 0, 0, 0, pad)) for x in args]
                seq_beta = F.pad(seq_beta, (0, 0, 0, pad))
                o, final = naive_chunk_kda(*args, seq_beta, initial_state=state, output_final_state=True)
            else:
                o, final = naive_recurrent_kda(*args, seq_beta, initial_state=state, output_final_state=True)
            outputs.append(o[:, : end - start])
            states.append(final)
        return KernelResult(torch.cat(outputs, dim=1), torch.cat(states, dim=0))


def naive_chunk_kda_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fla.ops.kda.chunk_kda(...)` for one packed batch `[1, T, ...]`, by fla-core's `naive_chunk_kda`."""
    if scale is not None or not use_qk_l2norm_in_kernel:
        raise ValueError(
            f"naive_chunk_kda_call serves chunk_kda(scale=None, use_qk_l2norm_in_kernel=True) only, got "
            f"{scale=}, {use_qk_l2norm_in_kernel=}"
        )
    if q.shape[0] != 1:
        raise ValueError(
            f"naive_chunk_kda_call takes one packed batch [1, T, H, D], got q of shape {list(q.shape)}"
        )
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    spans = list(itertools.pairwise(bounds))
    call = KernelCall(q, k, v, g, beta, spans, packed=cu_seqlens is not None, initial_state=initial_state)
    result = NaiveKernels().run("chunk", call)
    return result.o, result.final_state if output_final_state else None


class TritonKernels:
    """fla's Triton kernels, the packed batch in one call (GPU). For a lower-bound family's gates
    (`lower_bound` set: every g in [lower_bound, 0)) the chunk kernel runs as such a layer calls it,
    `safe_gate=True, lower_bound=...` on the precomputed g."""

    VJP_PATH = "chunk"  # chunk_kda's own backward

    def __init__(self, lower_bound: float | None = None):
        self.lower_bound = lower_bound
        self.name = "fla.ops.kda (chunk_kda, fused_recurrent_kda)" + (
            "" if lower_bound is None else f"; chunk_kda with safe_gate=True, lower_bound={lower_bound}"
        )

    def run(self, path: str, call: KernelCall) -> KernelResult:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        kernel = chunk_kda if path == "chunk" else fused_recurrent_kda
        cu_seqlens = None
        if call.packed:
            bounds = [start for start, _ in call.spans] + [call.spans[-1][1]]
            cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=call.q.device)
        bounded = {}
        if path == "chunk" and self.lower_bound is not None:
            bounded = {"safe_gate": True, "lower_bound": self.lower_bound}
        o, final = kernel(
            call.q,
            call.k,
            call.v,
            call.g,
            call.beta,
            initial_state=call.initial_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=not call.normalized,
            cu_seqlens=cu_seqlens,
            **bounded,
        )
        return KernelResult(o, final.float())


def kernel_backend(device: str, config: KDAConfig) -> KernelBackend:
    """The kernels of the kernel-level keys on `device` ("cpu" or "cuda") for layers of `config`'s family
    (the naive kernels take any precomputed g; the Triton chunk kernel is told a lower-bound gate's L)."""
    return NaiveKernels() if device == "cpu" else TritonKernels(config.gate_lower_bound)
