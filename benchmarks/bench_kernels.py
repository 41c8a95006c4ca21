"""`make bench`: the KDA kernels against the torch references on this machine, one table.

Times (median of a few runs, after one warm-up) at the real head shape H=32, D=128, one sequence of
T tokens in fp32; "first call" is trace + compile + run of the jitted JAX function. Also one decode
step for a batch of slots. Not a test: numbers for orientation, printed as a table.

    python -m benchmarks.bench_kernels [--tokens 256 1024 4096] [--repeats 3] [--decode-batch 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels import naive

HEADS, DIM = 32, 128


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(first-call seconds, median seconds of `repeats` further calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - start)
    return first, statistics.median(runs)


def kernel_inputs(tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    shape = (1, tokens, HEADS, DIM)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    g = -np.exp(rng.uniform(-5.0, 0.5, size=shape)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=shape[:3]).astype(np.float32)
    return [q, k, v, g, beta]


def jax_rows(tokens: int, inputs: list[np.ndarray], repeats: int) -> list[tuple[str, int, float, float]]:
    args = [jnp.asarray(x) for x in inputs]
    rows = []
    for name, kernel in (
        ("jax chunk_kda", naive.chunk_kda),
        ("jax fused_recurrent_kda", naive.fused_recurrent_kda),
    ):
        jitted = jax.jit(functools.partial(kernel, output_final_state=True))
        first, median = timed(lambda jitted=jitted: jitted(*args), repeats)
        rows.append((name, tokens, first, median))
    return rows


def torch_rows(tokens: int, inputs: list[np.ndarray], repeats: int) -> list[tuple[str, int, float, float]]:
    try:
        import torch
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
        from transformers.models.kimi_linear import modeling_kimi_linear
    except ImportError as err:
        print(f"(torch references skipped: {err})")
        return []
    tensors = [torch.from_numpy(x) for x in inputs]
    hf_chunk = getattr(modeling_kimi_linear.chunk_kimi_delta_attention, "__wrapped__", None) or (
        modeling_kimi_linear.chunk_kimi_delta_attention
    )
    candidates = [
        ("fla naive_recurrent_kda", lambda: naive_recurrent_kda(*tensors, output_final_state=True)),
        ("transformers chunk (torch)", lambda: hf_chunk(*tensors, output_final_state=True)),
    ]
    if tokens % 64 == 0:
        candidates.insert(
            1, ("fla naive_chunk_kda", lambda: naive_chunk_kda(*tensors, output_final_state=True))
        )
    rows = []
    with torch.inference_mode():
        for name, fn in candidates:
            runs = repeats if tokens <= 1024 else 1
            first, median = timed(fn, runs)
            rows.append((name, tokens, first, median))
    return rows


def decode_row(batch: int, repeats: int, rng: np.random.Generator) -> tuple[str, int, float, float]:
    slots = 2 * batch + 1
    buffer = jnp.zeros((slots, HEADS, DIM, DIM), jnp.float32)
    q, k, v, g, beta = (x[0, :batch] for x in kernel_inputs(batch, rng))
    indices = jnp.asarray(rng.permutation(slots)[:batch].astype(np.int32))
    step = jax.jit(
        lambda buf, *xs: naive.decode_kda_slots(*xs, state_buffer=buf, slot_indices=indices),
        donate_argnums=0,
    )
    state = {"buffer": buffer}

    def run():
        o, state["buffer"] = step(state["buffer"], q, k, v, g, beta)
        return o

    first, median = timed(run, repeats)
    return (f"jax decode_kda_slots (batch {batch}, {slots} slots)", 1, first, median)


def print_table(rows: list[tuple[str, int, float, float]]) -> None:
    header = f"{'kernel':52s} {'T':>6s} {'first call':>12s} {'median':>12s}"
    print(header)
    print("-" * len(header))
    for name, tokens, first, median in rows:
        print(f"{name:52s} {tokens:6d} {first:11.3f}s {1e3 * median:10.1f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--no-torch", action="store_true", help="skip the torch references")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, H={HEADS}, D={DIM}, fp32\n")
    rows = []
    for tokens in args.tokens:
        inputs = kernel_inputs(tokens, rng)
        rows += jax_rows(tokens, inputs, args.repeats)
        if not args.no_torch:
            rows += torch_rows(tokens, inputs, args.repeats)
    rows.append(decode_row(args.decode_batch, args.repeats, rng))
    print_table(rows)


if __name__ == "__main__":
    main()
