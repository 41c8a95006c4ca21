"""The float64 truth ("oracle"): the KDA layer computed again, independently, in float64.

The dump writer stores it for the layer's results (dump_gen.generate); the checker computes the kernels'
truth with the same recurrence on the dumped kernel inputs (conformance.checks.truth), so both judge
by one oracle.

numpy only, straight from the layer's math (docs/kda-layer.md, "Forward"): projections, the causal
depthwise short conv per sequence (zero conv state at each sequence start) and silu, the gate
of the layer's family (`kda_spec.families`): Kimi-Linear's `g = -exp(A_log) * softplus(f)` (softplus
`z` for `z > 20`, else `log1p(exp(z))`) or the lower-bound `g = L * sigmoid(exp(A_log) * f)`, with
`f = f_b_proj(f_a_proj(x)) + dt_bias`; `beta = sigmoid`,
the L2 norm of q and k with 1e-6, the delta rule token by token from each sequence's initial state,
the gated RMSNorm with the config's eps, and `o_proj`. Every function computes in the dtype it is
given (`layer_truth(..., dtype=...)`): float64 for the dumps; the tests run the same code in float32
and in np.longdouble to show that the float64 results are float64-accurate.

Why not the reference layer itself in float64: it cannot compute in float64. transformers 5.24.0,
`transformers/models/kimi_linear/modeling_kimi_linear.py`, casts to float32 inside, whatever the
module's dtype, and casts the result back, so a `layer.double()` run returns float64 tensors holding
float32 values:
- `KimiLinearRMSNormGated.forward` (the output norm): lines 87, 90, 93 `.to(torch.float32)` of the
  input, the weight and the gate; line 95 `.to(input_dtype)` back;
- `KimiLinearForgetGate.forward` (the gate): line 336 `forget_gate.float()`, `dt_bias.float()`,
  line 337 `A_log.float()`;
- `recurrent_kimi_delta_attention`: line 427 q, k, v, g, beta `.to(torch.float32)`;
  `chunk_kimi_delta_attention`: line 484 the same, line 519 the decay mask `.float()`;
- `KimiLinearDeltaAttention.forward`: line 709 the cached recurrent state `.to(torch.float32)`.
fla-core 0.6.0's torch references, `fla/ops/kda/naive.py`, do the same: `naive_recurrent_kda` line 51
and `naive_chunk_kda` lines 115-116 `.to(torch.float)`, and float32 buffers at lines 126, 136, 154.
Measured on the mini preset (T65, varlen_initstate): transformers' layer moved to float64
(`layer.double()`, float64 inputs) returns `out` and `o_norm` in float64 yet 1.2e-6 to 1.8e-6 (max abs
error over max abs value) from this module, as far as its float32 run (1.5e-6), and its gate `g` in
float32; this module agrees with an np.longdouble run of itself to 1e-15 (tests/dump_gen/test_truth.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.families import canonical_weights
from kda_spec.weight_names import fp32_weights

# An error added to every result of a sum of products `sum_i a_i b_i`, given each one's `summation_scale`
# (the scale of a summation order's rounding): `layer_truth(reduction_error=...)`.
ReductionError = Callable[[np.ndarray], np.ndarray]


def summation_scale(total: np.ndarray, squares: np.ndarray, terms: int) -> np.ndarray:
    """The scale of the rounding error of a `terms`-term sum, from its `total` and the sum of its terms'
    `squares`: the root of the expected sum of its squared partial sums, `sqrt(E sum_j s_j^2)`, for terms
    drawn alike with the total's mean and the squares' spread, `sqrt(total^2 K/3 + max(0, squares -
    total^2/K) K/2)`. A sequential fp32 sum rounds each partial sum once, so its error is of order
    2^-24 times this, whether its terms cancel (partial sums a random walk: `K/2` times the variance) or
    add up (partial sums growing to the total: `K/3` times its square)."""
    k = float(terms)
    return np.sqrt(total * total * k / 3 + np.maximum(0.0, squares - total * total / k) * k / 2)


IMPLEMENTATION = (
    "kda_spec.truth: the layer's math re-implemented in numpy float64 (projections, causal short conv, "
    "gate, beta, l2norm, token-by-token delta rule, gated RMSNorm, o_proj), independent of the reference"
)
# A dump stores the truth of the intermediates (16 bytes per element for the two runs, more than the
# reference's own 6) for cases of at most this many tokens, the RFC's twelve, not a long context;
# that of the output and the states for every case.
INTERMEDIATES_MAX_TOKENS = 1024
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def bf16_rounded(array: np.ndarray) -> np.ndarray:
    """float32 `array` rounded to bf16 as the bf16 run rounds it (to nearest even), back in float32."""
    return np.asarray(array, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def run_weights(weights: Mapping[str, np.ndarray], dtype: str, config: KDAConfig) -> dict[str, np.ndarray]:
    """The weights (`config`'s family's names) the `dtype` run ("fp32" or "bf16") computes with: in the
    bf16 run rounded to bf16, except the family's fp32 weights (`weight_names.fp32_weights`: A_log and
    dt_bias, and GLM's fused conv), which it keeps in fp32. The truth of a run starts from these."""
    if dtype == "fp32":
        return dict(weights)
    kept = fp32_weights(config)
    return {name: array if name in kept else bf16_rounded(array) for name, array in weights.items()}


def run_hidden_states(hidden_states: np.ndarray, dtype: str) -> np.ndarray:
    """The layer input the `dtype` run sees: the dumped float32 hidden states, rounded in the bf16 run."""
    return np.asarray(hidden_states, np.float32) if dtype == "fp32" else bf16_rounded(hidden_states)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """`1 / (1 + exp(-x))`, without overflow for large negative x."""
    return np.exp(-np.logaddexp(0, -x))


def softplus(z: np.ndarray) -> np.ndarray:
    """`z` for `z > 20`, else `log1p(exp(z))` (the reference's threshold)."""
    return np.where(z > SOFTPLUS_THRESHOLD, z, np.log1p(np.exp(np.minimum(z, SOFTPLUS_THRESHOLD))))


def forget_gate(f: np.ndarray, a_log: np.ndarray, config: KDAConfig) -> np.ndarray:
    """The log decay `g` [T, H, D] from the gate's input `f` [T, H, D] (`dt_bias` added) and `A_log`
    (H values), in the family's form: `-exp(A_log) * softplus(f)`, or `L * sigmoid(exp(A_log) * f)` for
    a lower-bound family with `L = config.gate_lower_bound`."""
    rate = np.exp(a_log.reshape(config.num_heads, 1))
    if config.kda_family.lower_bound_gate:
        return np.asarray(config.gate_lower_bound, f.dtype) * sigmoid(rate * f)
    return -rate * softplus(f)


def raw_gate_decay(
    g_raw: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, config: KDAConfig
) -> np.ndarray:
    """The log decay `g` [T, H, D] from the raw gate `g_raw` [T, H, D] (`f_b_proj(f_a_proj(x))`, the
    dump's `g_raw`), `A_log` (H values) and `dt_bias` (H·D values): `forget_gate(g_raw + dt_bias)`."""
    return forget_gate(g_raw + dt_bias.reshape(config.num_heads, config.head_dim), a_log, config)


def causal_conv(u: np.ndarray, weight: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """The causal depthwise conv of `u` [T, C] with `weight` [C, 1, W] (before its silu), each sequence of
    `spans` from a zero conv state: `y[t] = sum_j weight[:, 0, j] * u[t - (W-1) + j]`."""
    width = weight.shape[-1]
    taps = weight[:, 0, :]
    y = np.empty_like(u)
    for start, end in spans:
        padded = np.concatenate([np.zeros((width - 1, u.shape[1]), u.dtype), u[start:end]])
        y[start:end] = sum(taps[:, j] * padded[j : j + end - start] for j in range(width))
    return y


def short_conv(
    u: np.ndarray,
    weight: np.ndarray,
    spans: list[tuple[int, int]],
    reduction_error: ReductionError | None = None,
) -> np.ndarray:
    """silu of `causal_conv(u [T, C], weight [C, 1, W], spans)`; `reduction_error` (`layer_truth`) is added
    to each sum before the silu, given its terms' squares (the same conv of u² with weight²)."""
    y = causal_conv(u, weight, spans)
    if reduction_error is not None:
        squares = causal_conv(u * u, weight * weight, spans)
        for start, end in spans:  # one draw per sequence, in order
            scale = summation_scale(y[start:end], squares[start:end], weight.shape[-1])
            y[start:end] += reduction_error(scale)
    return y * sigmoid(y)


def l2_normalised(x: np.ndarray) -> np.ndarray:
    """`x / sqrt(sum(x * x) + 1e-6)` over the last axis."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One sequence, token by token, all heads at once: q, k (L2-normalised), v, g [T, H, D], beta [T, H],
    initial `state` [H, D_k, D_v]. Returns o [T, H, D] and the final state.

    `S = S * exp(g_t)[:, None]; S = S + beta_t * outer(k_t, v_t - k_t @ S); o_t = (D ** -0.5 * q_t) @ S`.
    """
    scale = 1 / np.sqrt(np.asarray(q.shape[-1], dtype=q.dtype))
    decay = np.exp(g)[..., None]
    state = state.copy()
    o = np.empty_like(v)
    for t in range(q.shape[0]):
        state *= decay[t]
        delta = beta[t][:, None] * (v[t] - (k[t][:, None, :] @ state)[:, 0])
        state += k[t][:, :, None] * delta[:, None, :]
        o[t] = (scale * q[t][:, None, :] @ state)[:, 0]
    return o, state


def _sequence_initial_state(
    initial_state: np.ndarray | None,  # [N, H, D_k, D_v] or None (zeros)
    index: int,
    q: np.ndarray,  # [T, H, D_k]
    v: np.ndarray,  # [T, H, D_v]
) -> np.ndarray:
    """Sequence `index`'s initial state `[H, D_k, D_v]` in q's dtype."""
    if initial_state is None:
        return np.zeros((q.shape[1], q.shape[2], v.shape[2]), q.dtype)
    return np.asarray(initial_state[index], q.dtype)


def packed_delta_rule(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """`delta_rule` on a packed batch: q, k (L2-normalised), v, g [T, H, D], beta [T, H], `cu_seqlens`
    [N+1], `initial_state` [N, H, D_k, D_v] or None (zeros). Returns o [T, H, D] and the final states
    [N, H, D_k, D_v], in q's dtype."""
    o = np.empty_like(v)
    states = []
    for index, (start, end) in enumerate(itertools.pairwise(np.asarray(cu_seqlens).tolist())):
        state = _sequence_initial_state(initial_state, index, q, v)
        o[start:end], final = delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state
        )
        states.append(final)
    return o, np.stack(states)


# The gradients `delta_rule_vjp` returns, by name: of q, k, v, g, beta and the initial state (fla's names).
GRADIENT_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# `delta_rule_vjp` keeps the state every this many tokens and recomputes the states in between.
VJP_BLOCK_TOKENS = 64


def delta_rule_vjp(
    q: np.ndarray,  # [T, H, D_k] l2-normalised
    k: np.ndarray,  # [T, H, D_k] l2-normalised
    v: np.ndarray,  # [T, H, D_v]
    g: np.ndarray,  # [T, H, D_k]
    beta: np.ndarray,  # [T, H]
    state: np.ndarray,  # [H, D_k, D_v] the initial state
    do: np.ndarray,  # [T, H, D_v] the output's cotangent
    dstate: np.ndarray,  # [H, D_k, D_v] the final state's cotangent
) -> dict[str, np.ndarray]:
    """The gradients of `sum(o * do) + sum(final_state * dstate)` for `delta_rule` on one sequence, by
    `GRADIENT_NAMES` (`dh0` the initial state's), in q's dtype: reverse mode by hand, each token's update
    differentiated as `delta_rule` writes it. Per token, with P = exp(g_t) ⊙ S, u = v_t - Pᵀk_t,
    S' = P + β_t k_t uᵀ and o_t = scale · S'ᵀq_t, from dS' (the later tokens' gradient of S'):

        dS' += scale · q_t do_tᵀ     dq_t = scale · S' do_t      dw = dS'ᵀk_t (w = β_t u)
        dβ_t = dw · u                du = β_t dw                 dv_t = du
        dk_t = β_t dS' u - P du      dP = dS' - k_t duᵀ          dg_t = Σ_v dP ⊙ P
        dS = exp(g_t) ⊙ dP           (the gradient of the state before the token)

    The states come from a forward pass that keeps one every `VJP_BLOCK_TOKENS` tokens; the backward
    recomputes a block's states from its first: memory of T / 64 + 64 states, not T."""
    scale = 1 / np.sqrt(np.asarray(q.shape[-1], dtype=q.dtype))
    decay = np.exp(g)[..., None]
    tokens, block = q.shape[0], VJP_BLOCK_TOKENS
    starts = []  # the state entering each block
    state = np.array(state, dtype=q.dtype)
    for t in range(tokens):
        if t % block == 0:
            starts.append(state)
        _, _, state = _token_update(state, k[t], v[t], decay[t], beta[t])
    grads = {name: np.zeros_like(x) for name, x in zip(GRADIENT_NAMES[:5], (q, k, v, g, beta))}
    d_state = np.array(dstate, dtype=q.dtype)
    for first in reversed(range(0, tokens, block)):
        decayed, updates, states = [], [], []  # per token of the block: P, u, S'
        state = starts[first // block]
        for t in range(first, min(first + block, tokens)):
            p, u, state = _token_update(state, k[t], v[t], decay[t], beta[t])
            decayed.append(p)
            updates.append(u)
            states.append(state)
        for i in reversed(range(len(states))):
            t = first + i
            p, u, after = decayed[i], updates[i], states[i]
            d_state = d_state + scale * q[t][:, :, None] * do[t][:, None, :]
            grads["dq"][t] = scale * (after @ do[t][:, :, None])[..., 0]
            dw = (k[t][:, None, :] @ d_state)[:, 0]
            grads["dbeta"][t] = np.sum(dw * u, axis=-1)
            du = beta[t][:, None] * dw
            grads["dv"][t] = du
            grads["dk"][t] = (
                beta[t][:, None] * (d_state @ u[:, :, None])[..., 0] - (p @ du[:, :, None])[..., 0]
            )
            dp = d_state - k[t][:, :, None] * du[:, None, :]
            grads["dg"][t] = np.sum(dp * p, axis=-1)
            d_state = decay[t] * dp
    return {**grads, "dh0": d_state}


def _token_update(
    state: np.ndarray,  # [H, D_k, D_v] S, the state before the token
    k: np.ndarray,  # [H, D_k] the token's
    v: np.ndarray,  # [H, D_v]
    decay: np.ndarray,  # [H, D_k, 1] exp(g_t)
    beta: np.ndarray,  # [H]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token of `delta_rule` as `delta_rule_vjp` keeps it: (P = exp(g_t) ⊙ S, u = v_t - Pᵀk_t, the state
    after the token P + β_t k_t uᵀ), rounded as `delta_rule` rounds them, new arrays (S unchanged)."""
    p = state * decay
    u = v - (k[:, None, :] @ p)[:, 0]
    return p, u, p + k[:, :, None] * (beta[:, None] * u)[:, None, :]


def packed_delta_rule_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
    do: np.ndarray,  # [T, H, D_v]
    dht: np.ndarray,  # [N, H, D_k, D_v]
) -> dict[str, np.ndarray]:
    """`delta_rule_vjp` on a packed batch (arguments as `packed_delta_rule`; `do`, `dht` the cotangents
    of the output and the final states): the gradients by `GRADIENT_NAMES`, `dh0` [N, H, D_k, D_v]."""
    grads = {name: np.zeros_like(x) for name, x in zip(GRADIENT_NAMES[:5], (q, k, v, g, beta))}
    initial_grads = []
    for index, (start, end) in enumerate(itertools.pairwise(np.asarray(cu_seqlens).tolist())):
        rows = slice(start, end)
        state = _sequence_initial_state(initial_state, index, q, v)
        one = delta_rule_vjp(
            q[rows], k[rows], v[rows], g[rows], beta[rows], state, do[rows], np.asarray(dht[index], q.dtype)
        )
        for name in GRADIENT_NAMES[:5]:
            grads[name][rows] = one[name]
        initial_grads.append(one["dh0"])
    return {**grads, "dh0": np.stack(initial_grads)}


def chunk_starts(seq_lens: tuple[int, ...] | list[int], chunk_size: int) -> list[tuple[int, int]]:
    """The chunks of a packed batch as fla's `chunk_kda(..., return_intermediate_states=True)` orders
    its states `h` with `cu_seqlens`: for each sequence in order, ceil(T_i / chunk_size) chunks; each
    as (sequence index, tokens of the sequence before the chunk)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(index, start) for index, length in enumerate(seq_lens) for start in range(0, length, chunk_size)]


def packed_chunk_start_states(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
    chunk_size: int,
) -> np.ndarray:
    """The state entering every chunk of `chunk_size` tokens (`chunk_starts`' order): the c-th chunk of a
    sequence starts from its state after c·chunk_size tokens, the first from its initial state; the
    delta rule token by token (`delta_rule`). Arguments as `packed_delta_rule`. Returns
    [NT, H, D_k, D_v] in q's dtype, NT = sum of ceil(T_i / chunk_size) (fla's `h` without its batch axis)."""
    heads, dim = q.shape[1], q.shape[2]
    cu = np.asarray(cu_seqlens).tolist()
    starts, state = [], None
    for index, before in chunk_starts([end - begin for begin, end in itertools.pairwise(cu)], chunk_size):
        if before == 0:  # a sequence starts
            state = _sequence_initial_state(initial_state, index, q, v)
        starts.append(state)
        rows = slice(cu[index] + before, min(cu[index] + before + chunk_size, cu[index + 1]))
        _, state = delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
    return np.stack(starts) if starts else np.zeros((0, heads, dim, v.shape[2]), q.dtype)


def gated_rms_norm(o: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`o * rsqrt(mean(o * o) + eps) * weight * sigmoid(gate)` over each head's last axis."""
    return o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * weight * sigmoid(gate)


def layer_truth(
    weights: Mapping[str, np.ndarray],
    hidden_states: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
    config: KDAConfig,
    dtype: type[np.floating] = np.float64,
    rounded: Callable[[np.ndarray], np.ndarray] | None = None,
    operand: Callable[[np.ndarray], np.ndarray] | None = None,
    reduction_error: ReductionError | None = None,
) -> dict[str, np.ndarray]:
    """The layer on one packed batch, every step in `dtype`: `out` [T, hidden], `recurrent_state`
    [N, H, D, D] and the dump's intermediates (`q_after_conv` ... `o_norm`, and the raw gate `g_raw`),
    by their dump names.

    `weights` by HF name of `config`'s family (kda_spec.weight_names), `hidden_states` [T, hidden],
    `cu_seqlens` [N+1],
    `initial_state` [N, H, D, D] or None (zeros); whatever their dtype, they are converted exactly.
    `rounded`: applied at the precision contract's bf16 rounding points (`_layer`); None rounds nowhere.
    `operand`: applied to both operands of every projection, the product then exact (a matmul that
    rounds its inputs: `operand_rounding`); None leaves them as they are.
    `reduction_error`: added to the result of every sum of products of the layer outside the recurrence
    (each projection's and o_proj's dot products, the short conv's sums), given each result's
    `summation_scale` (a summation order's rounding: `conformance.checks.truth.computed_reduction_spread`);
    the norms' sums of squares are left exact. None adds none.
    """
    w = {name: np.asarray(array, dtype) for name, array in canonical_weights(config, weights).items()}
    spans = list(itertools.pairwise(np.asarray(cu_seqlens).tolist()))

    def recurrence(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        return packed_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state)

    return _layer(
        w,
        np.asarray(hidden_states, dtype),
        spans,
        0,
        recurrence,
        config,
        rounded or _exact,
        operand or _exact,
        reduction_error,
    )


def layer_truths(
    weights: Mapping[str, np.ndarray],
    hidden_states: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
    config: KDAConfig,
    reduction_errors: Sequence[ReductionError | None],
) -> list[dict[str, np.ndarray]]:
    """`layer_truth` in float64 once per entry of `reduction_errors` (its `reduction_error`; None: none),
    arguments as there, their recurrences run as one: every run's heads side by side in one packed delta
    rule, so that a few runs cost about one's token loop."""
    w = {name: np.asarray(array, np.float64) for name, array in canonical_weights(config, weights).items()}
    x = np.asarray(hidden_states, np.float64)
    spans = list(itertools.pairwise(np.asarray(cu_seqlens).tolist()))
    projections = [_Projections(w, reduction_error=error) for error in reduction_errors]
    stages = [_kernel_stages(x, spans, 0, config, project) for project in projections]
    side_by_side = [np.concatenate(parts, axis=1) for parts in zip(*map(_kernel_inputs, stages))]
    init = None if initial_state is None else np.asarray(initial_state, np.float64)
    inits = None if init is None else np.concatenate([init] * len(stages), axis=1)
    o, states = packed_delta_rule(*side_by_side, cu_seqlens, inits)
    heads = config.num_heads
    return [
        _after_kernel(
            run, o[:, i * heads : (i + 1) * heads], states[:, i * heads : (i + 1) * heads], config, project
        )
        for i, (run, project) in enumerate(zip(stages, projections))
    ]


def mantissa_rounded(array: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """`array` rounded to nearest (ties to even) to `mantissa_bits` explicit mantissa bits with float32's
    exponent range, via float32 (bf16: 7 bits, TF32: 10 bits), back in its own dtype: the operands a
    reduced-precision matmul pass multiplies."""
    if not 0 < mantissa_bits < 23:
        raise ValueError(f"mantissa_bits must be in 1..22, got {mantissa_bits}")
    bits = np.asarray(array, np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - mantissa_bits
    half, lowest_kept = np.uint64(1 << (drop - 1)), (bits >> np.uint64(drop)) & np.uint64(1)
    kept = ((bits + half - np.uint64(1) + lowest_kept) >> np.uint64(drop)) << np.uint64(drop)
    rounded = kept.astype(np.uint32).view(np.float32)
    finite = np.isfinite(np.asarray(array, np.float32))
    return np.where(finite, rounded, np.asarray(array, np.float32)).astype(np.asarray(array).dtype)


def bf16_contract_rounding(array: np.ndarray) -> np.ndarray:
    """`array` rounded to bf16 (via float32, as an fp32 pipeline rounds it), back in its own dtype."""
    return bf16_rounded(array).astype(array.dtype)


# A long case's truth of the output and the final states is computed this many tokens at a time, so
# that no [T, H, D] array of the whole sequence is held in float64 (at the real size one is 512 MiB
# for T = 16384, and the whole-sequence layer holds about a dozen).
BLOCK_TOKENS = 1024


def layer_output_truth(
    weights: Mapping[str, np.ndarray],
    hidden_states: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray | None,
    config: KDAConfig,
    dtype: type[np.floating] = np.float64,
    block_tokens: int = BLOCK_TOKENS,
    rounded: Callable[[np.ndarray], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """`out` [T, hidden] and `recurrent_state` [N, H, D, D] of `layer_truth` (the same math, no
    intermediates), each sequence taken `block_tokens` tokens at a time: a block's short conv reads the
    previous block's last `conv_size - 1` inputs, and its delta rule starts from the state the previous
    block left. Memory grows with `block_tokens`, not with T. `rounded` as for `layer_truth`."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    w = {name: np.asarray(array, dtype) for name, array in canonical_weights(config, weights).items()}
    x = np.asarray(hidden_states, dtype)
    heads, dim, tail = config.num_heads, config.head_dim, config.conv_size - 1
    out = np.empty((x.shape[0], w["o_proj.weight"].shape[0]), dtype)
    states = []
    for index, (start, end) in enumerate(itertools.pairwise(np.asarray(cu_seqlens).tolist())):
        state = (
            np.zeros((heads, dim, dim), dtype)
            if initial_state is None
            else np.asarray(initial_state[index], dtype)
        )
        for block_start in range(start, end, block_tokens):
            block_end = min(block_start + block_tokens, end)
            context = max(start, block_start - tail)  # the conv's inputs before the block, in the sequence
            block = _layer(
                w,
                x[context:block_end],
                [(0, block_end - context)],
                block_start - context,
                functools.partial(delta_rule, state=state),
                config,
                rounded or _exact,
            )
            out[block_start:block_end], state = block["out"], block["recurrent_state"]
        states.append(state)
    return {"out": out, "recurrent_state": np.stack(states)}


Recurrence = Callable[
    [np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]
]


def _exact(array: np.ndarray) -> np.ndarray:
    return array


def _layer(
    w: Mapping[str, np.ndarray],
    x: np.ndarray,
    spans: list[tuple[int, int]],
    skip: int,
    recurrence: Recurrence,
    config: KDAConfig,
    rounded: Callable[[np.ndarray], np.ndarray] = _exact,
    operand: Callable[[np.ndarray], np.ndarray] = _exact,
    reduction_error: ReductionError | None = None,
) -> dict[str, np.ndarray]:
    """The layer's math with canonical weights `w` on the rows `x[skip:]` of `x` [T, hidden], `x[:skip]`
    being only the short conv's context; `spans` the sequences of `x`, each from a zero conv state;
    `recurrence(q, k, v, g, beta)` the delta rule from the right initial states, returning (o, final
    states). Every result by its dump name: `out`, `recurrent_state` (what `recurrence` returns) and
    the intermediates.

    `rounded` is applied at each bf16 rounding point of the precision contract (docs/bf16-rounding.md):
    every projection's output, the conv after silu, the kernel output o, the gated norm's output and
    `out`; beta's sigmoid, the gate g, the l2 norm and the recurrence take the rounded values exactly.
    The truth rounds nowhere (`_exact`); the contract's model rounds with `bf16_contract_rounding`.
    `operand` is applied to both operands of every projection, `reduction_error` added to every
    projection's and conv sum's result (`layer_truth`)."""
    project = _Projections(w, rounded, operand, reduction_error)
    stages = _kernel_stages(x, spans, skip, config, project)
    o, states = recurrence(*_kernel_inputs(stages))
    return _after_kernel(stages, o, states, config, project)


@dataclasses.dataclass(frozen=True)
class _Projections:
    """The layer's projections with canonical weights `w`, as `_layer` computes them (`rounded`,
    `operand`, `reduction_error` as there): `project(a [T, in], name)` is `name`'s output [T, out]."""

    w: Mapping[str, np.ndarray]
    rounded: Callable[[np.ndarray], np.ndarray] = _exact
    operand: Callable[[np.ndarray], np.ndarray] = _exact
    reduction_error: ReductionError | None = None

    def __call__(self, a: np.ndarray, name: str) -> np.ndarray:
        weight = self.w[f"{name}.weight"]
        y = self.operand(a) @ self.operand(weight).T
        if self.reduction_error is not None:
            squares = (a * a) @ (weight * weight).T
            y = y + self.reduction_error(summation_scale(y, squares, a.shape[-1]))
        return self.rounded(y)


def _kernel_stages(
    x: np.ndarray, spans: list[tuple[int, int]], skip: int, config: KDAConfig, project: _Projections
) -> dict[str, np.ndarray]:
    """The layer's results before its recurrence (`_layer`'s arguments): `q/k/v_after_conv`, `g`,
    `g_raw`, `beta`, `g_out`, by dump name."""
    w, heads, dim = project.w, config.num_heads, config.head_dim
    tokens = x.shape[0] - skip

    def per_head(a: np.ndarray) -> np.ndarray:
        return a.reshape(tokens, heads, dim)

    def conv(n: str) -> np.ndarray:
        y = short_conv(project(x, f"{n}_proj"), w[f"{n}_conv1d.weight"], spans, project.reduction_error)
        return per_head(project.rounded(y)[skip:])

    q, k, v = (conv(n) for n in "qkv")
    x = x[skip:]
    g_raw = per_head(project(project(x, "f_a_proj"), "f_b_proj"))
    return {
        "q_after_conv": q,
        "k_after_conv": k,
        "v_after_conv": v,
        "g": raw_gate_decay(g_raw, w["A_log"], w["dt_bias"], config),
        "g_raw": g_raw,
        "beta": sigmoid(project(x, "b_proj")),
        "g_out": per_head(project(project(x, "g_a_proj"), "g_b_proj")),
    }


def _kernel_inputs(stages: Mapping[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """The recurrence's arguments from `_kernel_stages`: q and k l2-normalised, v, g, beta."""
    return (
        l2_normalised(stages["q_after_conv"]),
        l2_normalised(stages["k_after_conv"]),
        stages["v_after_conv"],
        stages["g"],
        stages["beta"],
    )


def _after_kernel(
    stages: Mapping[str, np.ndarray],
    o: np.ndarray,  # [T, H, D] the recurrence's output
    states: np.ndarray,  # [N, H, D, D] its final states
    config: KDAConfig,
    project: _Projections,
) -> dict[str, np.ndarray]:
    """Every result of `_layer` from its `stages` and the recurrence's `o` and final `states`."""
    tokens, heads, dim = o.shape
    rounded = project.rounded
    o_norm = rounded(
        gated_rms_norm(rounded(o), stages["g_out"], project.w["o_norm.weight"], config.rms_norm_eps)
    )
    return {
        "out": project(o_norm.reshape(tokens, heads * dim), "o_proj"),
        "recurrent_state": states,
        **stages,
        "o_norm": o_norm,
    }
