"""Random KDA kernel inputs from replayable seeds (`$KDA_TEST_SEED`), the references (fla's torch kernels,
kda_impl's float64 chunk form) and the kernel call, shared by the kernel tests."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

SEED_ENV = "KDA_TEST_SEED"
DEFAULT_SEED = 1234


def random_kernel_inputs(
    rng: np.random.Generator,
    tokens: int,
    *,
    heads: int = 2,
    dim: int = 32,
    batch: int = 1,
    decay: str = "realistic",
) -> dict[str, np.ndarray]:
    """q, k, v, g [B, T, H, D], beta [B, T, H] in fp32.

    decay: "realistic" — g = -exp(A_log) * softplus(f) with A_log = log U(1, 16) and f around the
    inverse softplus of dt in [1e-3, 1e-1]; "strong" — g uniform in [-60, 0] (exp(A_log) = 16 with a
    large softplus); "mixed" — strong and near-zero decays interleaved along time.
    """
    shape = (batch, tokens, heads, dim)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    if decay == "realistic":
        a = rng.uniform(1.0, 16.0, size=(1, 1, heads, 1))
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=(heads, dim)))
        f = np.log(np.expm1(dt)) + rng.standard_normal(shape)
        g = -a * np.logaddexp(0.0, f)
    elif decay == "strong":
        g = -rng.uniform(0.0, 60.0, size=shape)
    elif decay == "mixed":
        strong = rng.uniform(0.0, 60.0, size=shape)
        weak = rng.uniform(0.0, 0.05, size=shape)
        g = -np.where(rng.uniform(size=(*shape[:2], 1, 1)) < 0.3, strong, weak)
    else:
        raise ValueError(f"unknown decay {decay!r}")
    beta = rng.uniform(0.0, 1.0, size=shape[:3]).astype(np.float32)
    return {"q": q, "k": k, "v": v, "g": g.astype(np.float32), "beta": beta}


def l2normalise(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def seed_from_env() -> int:
    """The tests' base seed: `$KDA_TEST_SEED`, else `DEFAULT_SEED`."""
    text = os.environ.get(SEED_ENV, str(DEFAULT_SEED))
    if not text.strip().isdigit():
        raise ValueError(f"${SEED_ENV}={text!r} must be a non-negative integer")
    return int(text)


def seeded_rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """The test's generator: the base seed mixed with the test's id, so every test draws its own inputs,
    the same ones each run. The seed is recorded with the test; a failure report names it (conftest)."""
    seed = seed_from_env()
    request.node.user_properties.append((SEED_ENV, seed))
    return np.random.default_rng([seed, zlib.crc32(request.node.nodeid.encode())])


def fla_reference(
    inputs: dict[str, np.ndarray], initial_state: np.ndarray | None, chunked: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """fla-core's naive torch kernels on l2-normalised q, k: (o [B, T, H, V], final state [B, H, K, V])."""
    import torch
    from fla.ops.kda import naive as fla_naive

    tensors = [
        torch.from_numpy(np.ascontiguousarray(x))
        for x in (
            l2normalise(inputs["q"]),
            l2normalise(inputs["k"]),
            inputs["v"],
            inputs["g"],
            inputs["beta"],
        )
    ]
    h0 = None if initial_state is None else torch.from_numpy(initial_state)
    tokens = tensors[0].shape[1]
    flushed = torch.set_flush_denormal(True)  # strong decays make denormals, which torch runs slowly
    try:
        if not chunked:
            o, state = fla_naive.naive_recurrent_kda(*tensors, initial_state=h0, output_final_state=True)
        else:
            pad = -tokens % 64  # naive_chunk_kda needs whole chunks; zero k/v/g/beta rows leave S unchanged
            padded = [torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, pad)) for x in tensors]
            o, state = fla_naive.naive_chunk_kda(*padded, initial_state=h0, output_final_state=True)
    finally:
        if flushed:
            torch.set_flush_denormal(False)
    return o[:, :tokens].numpy(), state.numpy()


def reference_chunk_fp64(
    inputs: dict[str, np.ndarray], initial_state: np.ndarray | None = None, **kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """The chunk form's reference: `reference_chunk_kda` in float64 on `inputs` (q, k normalised in-kernel),
    (o, final state) as float64 numpy; `kwargs` as the kernels take them (`cu_seqlens`, `chunk_size`)."""
    import jax

    from kda_impl.kernels.reference_chunk import reference_chunk_kda

    with jax.enable_x64(True):
        wide = {name: x.astype(np.float64) for name, x in inputs.items()}
        h0 = None if initial_state is None else initial_state.astype(np.float64)
        return run_kernel(reference_chunk_kda, wide, initial_state=h0, **kwargs)


def run_kernel(kernel, inputs: dict[str, np.ndarray], **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """`kernel` on `inputs` with q, k normalised in-kernel; (o, final state) as numpy."""
    o, state = kernel(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs,
    )  # fmt: skip
    return np.asarray(o), np.asarray(state)


def traces_over_batches(chunk_kda, inputs: dict[str, np.ndarray], batches: list[list[int]]) -> list[tuple]:
    """The `cu_seqlens` shapes jit traces `chunk_kda` with over `inputs` cut into each of `batches` (the
    sequence lengths of one packed batch); one entry per trace, none when a compiled call is reused."""
    import jax
    import jax.numpy as jnp

    traces = []

    def traced(*args, cu_seqlens):
        traces.append(cu_seqlens.shape)
        return chunk_kda(*args, cu_seqlens=cu_seqlens, output_final_state=True)

    kernel = jax.jit(traced)
    args = [jnp.asarray(inputs[name]) for name in ("q", "k", "v", "g", "beta")]
    for lengths in batches:
        cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        jax.block_until_ready(kernel(*args, cu_seqlens=cu_seqlens))
    return traces


def with_full_resets(
    inputs: dict[str, np.ndarray], rng: np.random.Generator, tokens: list[int], fraction: float = 0.02
) -> dict[str, np.ndarray]:
    """`inputs` with g = -inf (a full reset, exp(g) = 0) on every channel of the given packed tokens and on
    a random `fraction` of the other (token, head, channel) entries."""
    g = inputs["g"].copy()
    g[rng.uniform(size=g.shape) < fraction] = -np.inf
    g[:, tokens] = -np.inf
    return {**inputs, "g": g}
