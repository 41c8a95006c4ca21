"""Seeded random KDA kernel inputs with realistic and extreme gates, shared by the kernel tests."""

from __future__ import annotations

import numpy as np


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
