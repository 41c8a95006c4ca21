"""fla 0.6.0's forward options of the KDA kernels, checked and applied once for every entry point.

`chunk_kda`, `fused_recurrent_kda` (plain JAX and Pallas, through `entry.fla_entry`) and `decode_kda_slots`
(plain and Pallas, through `decode.prepare_decode`) take these keyword arguments, as fla's `chunk_kda`
does, and apply them here, on the fp32 inputs, before their kernel runs:

    use_gate_in_kernel: g is the gate's pre-activation input; the log decay is
        `-exp(A_log) * softplus(g + dt_bias)` (Kimi-Linear), or with `lower_bound=L` the lower-bound gate
        `L * sigmoid(exp(A_log) * (g + dt_bias))` (`common.kda_gate`); with `lower_bound`, A_log may be
        None: `L * sigmoid(g + dt_bias)`. A_log holds HV values (`[HV]`, or fla's `[1, 1, HV, 1]`);
        dt_bias `[HV * K]` or `[HV, K]`, optional. The Pallas chunk kernel computes it in-kernel.
    safe_gate: fla's switch to its faster kernel for bounded gates; with `use_gate_in_kernel` it needs
        `lower_bound` in [-5, 0). It changes no number here (every kernel is exact for any g <= 0).
    lower_bound: the lower-bound gate's L (only read with `use_gate_in_kernel`, as in fla).
    use_beta_sigmoid_in_kernel: beta is given as logits: `sigmoid(beta)`, or with `allow_neg_eigval`
        `2 * sigmoid(beta)` in (0, 2) (the write may flip the sign of the state along k).
    allow_neg_eigval: needs `use_beta_sigmoid_in_kernel`, as in fla.
    state_v_first: the states (initial, final, intermediate, a decode pool) are laid out `[..., V, K]`
        (FlashKDA's and vLLM's) instead of `[..., K, V]`.

GVA (grouped value heads): q and k have H heads, v, g, beta and the states HV = m * H; value head j
reads q/k head `j // m` (fla's `repeat_interleave`), so q and k are repeated to HV heads before the
kernel, which then runs HV independent heads.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels.common import KdaInputs, kda_gate

SAFE_GATE_LOWER_BOUNDS = (-5.0, 0.0)  # fla's safe range [-5, 0) of lower_bound with safe_gate
CHUNK_SIZES = (32, 64)  # the chunk sizes fla's chunk_kda accepts


@dataclasses.dataclass(frozen=True)
class FlaOptions:
    """The static (compile-time) fla options of one call, as `fla_options` checked them."""

    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    lower_bound: float | None = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False


GateArrays = tuple[jax.Array, jax.Array]  # A_log [HV] fp32 (0 when None: exp(0) = 1 exactly), dt_bias [HV, K]


def fla_options(
    *,
    g_shape: tuple[int, ...],  # [..., HV, K] the gate's (raw or log decay) shape
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Any = None,
    dt_bias: Any = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
) -> tuple[FlaOptions, GateArrays | None]:
    """Check the options as fla does (ValueError naming the argument) and return them with the gate's
    parameters as fp32 `(A_log [HV], dt_bias [HV, K])`, or None without `use_gate_in_kernel`.

    `transpose_state_layout` is fla's deprecated name of `state_v_first` (a DeprecationWarning; both at
    once are refused)."""
    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
            DeprecationWarning,
            stacklevel=4,
        )
        state_v_first = bool(transpose_state_layout)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if lower_bound is not None:
        lower_bound = float(lower_bound)
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError(
                "`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`."
            )
        low, high = SAFE_GATE_LOWER_BOUNDS
        if not low <= lower_bound < high:
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    gate = gate_arrays(use_gate_in_kernel, A_log, dt_bias, lower_bound, g_shape)
    options = FlaOptions(
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel),
        lower_bound=lower_bound if use_gate_in_kernel else None,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=bool(state_v_first),
    )
    return options, gate


def gate_arrays(
    use_gate_in_kernel: bool,
    a_log: Any,  # [HV] or any shape of HV values (fla's [1, 1, HV, 1]); None with lower_bound
    dt_bias: Any,  # [HV * K] or [HV, K], or None
    lower_bound: float | None,
    g_shape: tuple[int, ...],  # [..., HV, K]
) -> GateArrays | None:
    """The in-kernel gate's parameters as fp32 `(A_log [HV], dt_bias [HV, K])`, zeros for a None one
    (exact: `exp(0) * x` and `x + 0` are x), or None without the option; a ValueError names a missing,
    misshapen or unwanted one."""
    if not use_gate_in_kernel:
        if a_log is not None or dt_bias is not None:
            raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True")
        return None
    heads, key_dim = g_shape[-2:]
    if a_log is None:
        if lower_bound is None:
            raise ValueError(
                f"use_gate_in_kernel=True needs A_log of shape [HV]=({heads},) unless lower_bound is set, "
                "got None"
            )
        a_log = jnp.zeros((heads,), jnp.float32)
    if int(np.prod(jnp.shape(a_log))) != heads:
        raise ValueError(
            f"A_log.shape={jnp.shape(a_log)} must be [HV]=({heads},) (or any shape of HV values, e.g. "
            "fla's [1, 1, HV, 1])"
        )
    if dt_bias is None:
        dt_bias = jnp.zeros((heads, key_dim), jnp.float32)
    if jnp.shape(dt_bias) not in ((heads, key_dim), (heads * key_dim,)):
        raise ValueError(f"dt_bias.shape={jnp.shape(dt_bias)} must be [HV, K]={(heads, key_dim)} or [HV * K]")
    return (
        jnp.asarray(a_log, jnp.float32).reshape(heads),
        jnp.asarray(dt_bias, jnp.float32).reshape(heads, key_dim),
    )


def activated_beta(beta: jax.Array, options: FlaOptions) -> jax.Array:
    """beta, or `sigmoid(beta)` (times 2 with `allow_neg_eigval`) with `use_beta_sigmoid_in_kernel`."""
    if not options.use_beta_sigmoid_in_kernel:
        return beta
    activated = jax.nn.sigmoid(beta)
    return 2.0 * activated if options.allow_neg_eigval else activated


def value_head_inputs(inputs: KdaInputs) -> KdaInputs:
    """GVA: q and k `[..., H, K]` repeated to the HV heads of v (`[..., HV, V]`): value head j reads
    q/k head j // (HV / H). The inputs unchanged when HV = H."""
    heads, value_heads = inputs.q.shape[-2], inputs.v.shape[-2]
    if heads == value_heads:
        return inputs
    group = value_heads // heads
    return inputs._replace(q=jnp.repeat(inputs.q, group, axis=-2), k=jnp.repeat(inputs.k, group, axis=-2))


def gated(g: jax.Array, gate: GateArrays, lower_bound: float | None) -> jax.Array:
    """The log decay `[..., HV, K]` from the raw gate g (`common.kda_gate` with this call's parameters)."""
    a_log, dt_bias = gate
    return kda_gate(g, a_log[:, None], dt_bias, lower_bound)


def apply_options(
    inputs: KdaInputs,  # [..., H(V), ...] fp32, q and k l2-normalised if asked
    gate: GateArrays | None,
    options: FlaOptions,
    *,
    gate_in_kernel: bool = False,
) -> KdaInputs:
    """The inputs every kernel runs on: beta activated, q and k on the HV value heads, and g the log decay
    (unless `gate_in_kernel`: the kernel applies `gate` itself, to the raw g)."""
    inputs = value_head_inputs(inputs._replace(beta=activated_beta(inputs.beta, options)))
    if gate is not None and not gate_in_kernel:
        inputs = inputs._replace(g=gated(inputs.g, gate, options.lower_bound))
    return inputs


def validate_chunk_size(chunk_size: int) -> None:
    """fla's rule for the public `chunk_kda`: 32 or 64 (the internal kernels take other sizes)."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")


def swap_state_layout(state: jax.Array | None) -> jax.Array | None:
    """`[..., K, V]` <-> `[..., V, K]` (`state_v_first`)."""
    return None if state is None else jnp.swapaxes(state, -1, -2)


def fla_gate(
    g: jax.Array,  # [..., HV, K] the gate's input
    A_log: jax.Array | None = None,  # fla's name; HV values ([HV] or [1, 1, HV, 1]), None with lower_bound
    dt_bias: jax.Array | None = None,  # [HV * K] or [HV, K]
    lower_bound: float | None = None,
) -> jax.Array:
    """fla's `fused_kda_gate` (forward): the log decay `[..., HV, K]` fp32 the kernels compute from g with
    `use_gate_in_kernel`, checked as they check it."""
    gate = gate_arrays(True, A_log, dt_bias, lower_bound, jnp.shape(g))
    return gated(jnp.asarray(g), gate, lower_bound)
