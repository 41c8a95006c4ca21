"""A third JAX implementation of the KDA kernels, for the gradient checks: the chunked form written as
fla's naive chunk kernel and transformers' eager path write it (the in-chunk decays as a pairwise matrix,
the WY system solved by a triangular solve), its gradients by `jax.vjp`; and three defects of it.

- `NaiveChunkKernels`: faithful. Its pairwise decays `exp(G_i - G_j)` are masked *before* the exp
  (`where(j <= i, G_i - G_j, 0)`), so that no masked entry overflows.
- `ExpThenMask`: the mask applied after the exp, as transformers' eager path did before PR #48455: a
  masked entry `exp(G_i - G_j)`, j > i, overflows to inf where the decay is strong, the forward still
  selects 0, and the backward multiplies that inf by a zero cotangent: NaN gradients.
- `AnchoredAtChunkEnd`: the decays factorised around the chunk's last token, `exp(G_i - G_C) · exp(G_C -
  G_j)`: the same numbers in exact arithmetic, but every row of a chunk now rounds with the chunk's later
  gates (fla #1240): a causality break, to the bit.
- `BetaGradientScaled`: its dbeta 1% off.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from conformance.adapter import KERNEL_GRADIENTS, GradientAdapter, KernelAdapter
from kda_spec.families import FAMILIES

CHUNK = 16


def _decays(cumulative: jax.Array, causal: jax.Array, form: str) -> jax.Array:
    """[C, C, H, K] exp(G_i - G_j) for j <= i (0 above the diagonal), from the in-chunk cumulative log
    decays `cumulative` [C, H, K]; `form` "masked-exponent" (faithful), "exp-then-mask" or "anchored"."""
    mask = causal[:, :, None, None]
    difference = cumulative[:, None] - cumulative[None, :]
    if form == "exp-then-mask":
        return jnp.where(mask, jnp.exp(difference), 0.0)
    if form == "anchored":
        last = cumulative[-1]
        return jnp.where(mask, jnp.exp(cumulative - last)[:, None] * jnp.exp(last - cumulative)[None, :], 0.0)
    return jnp.exp(jnp.where(mask, difference, 0.0)) * mask


def _chunked(q, k, v, g, beta, state, form: str):
    """One sequence [T, H, D] (T a multiple of `CHUNK`, padded with k = v = beta = g = 0) from `state`
    [H, D, D]: o [T, H, D] and the final state, chunk by chunk (the module docstring)."""
    scale = q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    strict = jnp.tril(jnp.ones((CHUNK, CHUNK), bool), -1)

    def chunk(state, x):
        q, k, v, g, beta = x  # [C, H, D], beta [C, H]
        cumulative = jnp.cumsum(g, axis=0)
        decay = _decays(cumulative, causal, form)
        a_kk = jnp.einsum("ihk,jhk,ijhk->hij", k, k, decay) * beta.T[:, :, None] * strict
        a_qk = jnp.einsum("ihk,jhk,ijhk->hij", q, k, decay) * scale * causal
        solve = functools.partial(jax.scipy.linalg.solve_triangular, lower=True, unit_diagonal=True)
        system = a_kk + jnp.eye(CHUNK)
        gamma = jnp.exp(cumulative)  # [C, H, K]
        right = beta.T[:, :, None] * (jnp.swapaxes(v, 0, 1) - jnp.einsum("ihk,hkv->hiv", k * gamma, state))
        v_new = jax.vmap(solve)(system, right)  # [H, C, V]
        o = scale * jnp.einsum("ihk,hkv->ihv", q * gamma, state) + jnp.swapaxes(a_qk @ v_new, 0, 1)
        to_end = jnp.exp(cumulative[-1] - cumulative)  # [C, H, K]
        state = gamma[-1][:, :, None] * state + jnp.einsum("ihk,hiv->hkv", k * to_end, v_new)
        return state, o

    split = (x.reshape(-1, CHUNK, *x.shape[1:]) for x in (q, k, v, g, beta))
    state, o = jax.lax.scan(chunk, state, tuple(split))
    return o.reshape(-1, *o.shape[2:]), state


@functools.partial(jax.jit, static_argnames=("lengths", "form"))
def _packed(q, k, v, g, beta, initial_state, lengths: tuple[int, ...], form: str):
    """`_chunked` on each sequence of a packed batch of `lengths`: o [T, H, D] and the final states."""
    outputs, finals, start = [], [], 0
    for index, length in enumerate(lengths):
        padded = CHUNK * -(-length // CHUNK)

        def rows(x, start=start, length=length, padded=padded):
            return jnp.pad(x[start : start + length], [(0, padded - length)] + [(0, 0)] * (x.ndim - 1))

        o, final = _chunked(*(rows(x) for x in (q, k, v, g, beta)), initial_state[index], form)
        outputs.append(o[:length])
        finals.append(final)
        start += length
    return jnp.concatenate(outputs), jnp.stack(finals)


class NaiveChunkKernels(KernelAdapter, GradientAdapter):
    """The chunked form of fla's naive chunk kernel in JAX (module docstring), fp32; its recurrent kernel
    is the same function."""

    name = "naive chunk kernels (JAX, tests)"
    FAMILIES: ClassVar[frozenset[str]] = frozenset(FAMILIES)
    form = "masked-exponent"

    def _arguments(self, q, k, v, g, beta, cu_seqlens, initial_state) -> tuple[Any, ...]:
        lengths = tuple(int(n) for n in np.diff(cu_seqlens))
        init = np.zeros((len(lengths), *q.shape[1:], v.shape[-1]), np.float32)
        if initial_state is not None:
            init = np.asarray(initial_state, np.float32)
        return (*(np.asarray(x, np.float32) for x in (q, k, v, g, beta)), init), lengths

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        arrays, lengths = self._arguments(q, k, v, g, beta, cu_seqlens, initial_state)
        o, final = _packed(*arrays, lengths=lengths, form=self.form)
        return np.asarray(o), np.asarray(final)

    recurrent_kernel = chunk_kernel

    def chunk_kernel_vjp(self, q, k, v, g, beta, cu_seqlens, initial_state, do, dht):
        arrays, lengths = self._arguments(q, k, v, g, beta, cu_seqlens, initial_state)
        forward = functools.partial(_packed, lengths=lengths, form=self.form)
        _, pullback = jax.vjp(forward, *arrays)
        grads = pullback((jnp.asarray(do, jnp.float32), jnp.asarray(dht, jnp.float32)))
        return {name: np.asarray(grad, np.float32) for name, grad in zip(KERNEL_GRADIENTS, grads)}


class ExpThenMask(NaiveChunkKernels):
    name = "naive chunk kernels, the decay mask applied after the exp"
    form = "exp-then-mask"


class AnchoredAtChunkEnd(NaiveChunkKernels):
    name = "naive chunk kernels, the decays factorised around the chunk's last token"
    form = "anchored"


class BetaGradientScaled(NaiveChunkKernels):
    name = "naive chunk kernels, dbeta 1% off"

    def chunk_kernel_vjp(self, *args, **kwargs):
        grads = super().chunk_kernel_vjp(*args, **kwargs)
        return {**grads, "dbeta": grads["dbeta"] * np.float32(1.01)}
