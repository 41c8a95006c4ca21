"""The memory kda_impl's chunk kernel takes to train: its vector-Jacobian product (`jitted_kernel_vjp`, JAX's
autodiff of the plain-JAX chunk kernel) on one sequence of random fp32 inputs, at the real size by default
(T = 4096, H = 32, D = 128): the process's peak resident memory and XLA's own account of the compiled
program's buffers, and the time to compile and to run (docs/gradients.md, "Memory").

    python -m benchmarks.grad_memory [--tokens 4096] [--heads 32] [--dim 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import numpy as np

from conformance.adapters.kda_impl_adapter import jitted_kernel_vjp

GIB = 2**30


def inputs(tokens: int, heads: int, dim: int, seed: int) -> dict[str, np.ndarray]:
    """One sequence's kernel inputs and cotangents, fp32, with a batch axis of 1 where the kernel takes one:
    q, k unit rows, v and the cotangents N(0, 1), the log decay -exp(N(0, 1)) / 4, beta in (0, 1)."""
    rng = np.random.default_rng(seed)

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    shape = (1, tokens, heads, dim)
    return {
        "q": unit(rng.standard_normal(shape, np.float32)),
        "k": unit(rng.standard_normal(shape, np.float32)),
        "v": rng.standard_normal(shape, np.float32),
        "g": -np.exp(rng.standard_normal(shape, np.float32)) / 4,
        "beta": (1 / (1 + np.exp(-rng.standard_normal(shape[:3])))).astype(np.float32),
        "initial_state": np.zeros((1, heads, dim, dim), np.float32),
        "cu_seqlens": np.array([0, tokens], np.int32),
        "do": rng.standard_normal(shape, np.float32),
        "dht": rng.standard_normal((1, heads, dim, dim), np.float32),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    arrays = inputs(args.tokens, args.heads, args.dim, args.seed)
    positional = [arrays[name] for name in ("q", "k", "v", "g", "beta")]
    keywords = {name: arrays[name] for name in ("initial_state", "cu_seqlens", "do", "dht")}
    started = time.perf_counter()
    compiled = jitted_kernel_vjp().lower(*positional, **keywords).compile()
    compile_s = time.perf_counter() - started
    memory = compiled.memory_analysis()
    started = time.perf_counter()
    grads = jax.block_until_ready(compiled(*positional, **keywords))
    run_s = time.perf_counter() - started
    finite = all(bool(np.isfinite(np.asarray(grad)).all()) for grad in grads)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    print(f"kda_impl chunk kernel vjp, fp32, T={args.tokens} H={args.heads} D={args.dim}, {jax.devices()[0]}")
    if memory is not None:
        parts = {
            "arguments": memory.argument_size_in_bytes,
            "outputs": memory.output_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes,
        }
        listed = ", ".join(f"{name} {size / GIB:.2f}" for name, size in parts.items())
        print(f"XLA buffers: {sum(parts.values()) / GIB:.2f} GiB ({listed})")
    print(f"peak resident memory of the process: {peak / GIB:.2f} GiB")
    print(f"compile {compile_s:.1f} s, run {run_s:.1f} s; gradients finite: {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
