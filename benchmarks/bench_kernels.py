"""`make bench`: the KDA kernels against the torch references on this machine, one table.

H=32, D=128, fp32, one sequence (B=1) of T tokens. Each time is the min of `--repeats` back-to-back
calls after one warm-up; "first call" is trace + compile + run of the jitted JAX function. The ratio
column is (fla naive_recurrent_kda time) / (row time) at the same T, all measured in this one process.
A torch baseline whose estimated time (from its time at the previous T, scaled linearly) exceeds
`--skip-above` seconds per call is not run: the table says so instead of a number. Last, the time of
one 2048^3 fp32 matmul in JAX and in torch calibrates the machine, and one decode step for a batch of
slots. Not a test: numbers for orientation.

    python -m benchmarks.bench_kernels [--tokens 256 1024 4096 16384] [--repeats 3] [--decode-batch 64]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels import naive

HEADS, DIM = 32, 128
REFERENCE = "fla naive_recurrent_kda"


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(first-call seconds, min seconds of `repeats` further calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - start)
    return first, min(runs)


def kernel_inputs(tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    shape = (1, tokens, HEADS, DIM)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    g = -np.exp(rng.uniform(-5.0, 0.5, size=shape)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=shape[:3]).astype(np.float32)
    return [q, k, v, g, beta]


Row = tuple[str, int, float | None, float | None, str]  # name, T, first call, steady, note


def jax_rows(tokens: int, inputs: list[np.ndarray], repeats: int) -> list[Row]:
    args = [jnp.asarray(x) for x in inputs]
    rows = []
    for name, kernel in (
        ("jax chunk_kda", naive.chunk_kda),
        ("jax fused_recurrent_kda", naive.fused_recurrent_kda),
    ):
        jitted = jax.jit(functools.partial(kernel, output_final_state=True))
        first, steady = timed(lambda jitted=jitted: jitted(*args), repeats)
        rows.append((name, tokens, first, steady, ""))
    return rows


def torch_baselines(inputs: list[np.ndarray]) -> list[tuple[str, Callable[[], object]]]:
    """(name, call) of the torch references; [] without torch, fla or transformers."""
    try:
        import torch
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
        from transformers.models.kimi_linear import modeling_kimi_linear
    except ImportError as err:
        print(f"(torch references skipped: {err})")
        return []
    tensors = [torch.from_numpy(x) for x in inputs]
    hub_wrapped = modeling_kimi_linear.chunk_kimi_delta_attention  # may route to a hub kernel: unwrap
    hf_chunk = getattr(hub_wrapped, "__wrapped__", None) or hub_wrapped
    return [
        (REFERENCE, lambda: naive_recurrent_kda(*tensors, output_final_state=True)),
        ("fla naive_chunk_kda", lambda: naive_chunk_kda(*tensors, output_final_state=True)),
        (
            "transformers chunk_kimi_delta_attention (torch)",
            lambda: hf_chunk(*tensors, output_final_state=True),
        ),
    ]


def torch_rows(
    tokens: int, inputs: list[np.ndarray], repeats: int, estimates: dict[str, float], skip_above: float
) -> list[Row]:
    """Time each torch reference, unless `estimates[name] * tokens` (seconds) exceeds `skip_above`."""
    import torch

    rows = []
    with torch.inference_mode():
        for name, fn in torch_baselines(inputs):
            estimate = estimates.get(name, 0.0) * tokens
            if estimate > skip_above:
                rows.append((name, tokens, None, None, f"skipped (>{skip_above:.0f}s est.)"))
                continue
            first, steady = timed(fn, repeats)
            estimates[name] = steady / tokens
            rows.append((name, tokens, first, steady, ""))
    return rows


def matmul_rows(repeats: int) -> list[Row]:
    """One 2048 x 2048 x 2048 fp32 matmul in JAX and in torch: the machine's calibration line."""
    size = 2048
    a = jnp.ones((size, size), jnp.float32)
    product = jax.jit(lambda x: jnp.dot(x, x, precision=jax.lax.Precision.HIGHEST))
    rows = [("calibration: jax matmul 2048^3 fp32", size, *timed(lambda: product(a), repeats), "")]
    try:
        import torch
    except ImportError:
        return rows
    t = torch.ones(size, size)
    rows.append(("calibration: torch matmul 2048^3 fp32", size, *timed(lambda: t @ t, repeats), ""))
    return rows


def decode_row(batch: int, repeats: int, rng: np.random.Generator) -> Row:
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

    first, steady = timed(run, repeats)
    return (f"jax decode_kda_slots (batch {batch}, {slots} slots)", 1, first, steady, "")


def print_table(rows: list[Row]) -> None:
    reference = {tokens: steady for name, tokens, _, steady, _ in rows if name == REFERENCE and steady}
    header = f"{'kernel':48s} {'T':>6s} {'first call':>11s} {'time':>11s} {'vs fla recurrent':>17s}"
    print(header)
    print("-" * len(header))
    for name, tokens, first, steady, note in rows:
        if steady is None:
            print(f"{name:48s} {tokens:6d} {note:>41s}")
            continue
        ratio = f"{reference[tokens] / steady:16.2f}x" if tokens in reference else ""
        print(f"{name:48s} {tokens:6d} {first:10.3f}s {1e3 * steady:9.1f}ms {ratio:>17s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--skip-above", type=float, default=60.0, help="seconds per torch call to skip")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch references")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, H={HEADS}, D={DIM}, fp32, B=1\n")
    rows: list[Row] = []
    estimates: dict[str, float] = {}  # torch seconds per token, from the previous T
    for tokens in sorted(args.tokens):
        inputs = kernel_inputs(tokens, rng)
        rows += jax_rows(tokens, inputs, args.repeats)
        if not args.no_torch:
            rows += torch_rows(tokens, inputs, args.repeats, estimates, args.skip_above)
    rows += matmul_rows(args.repeats)
    rows.append(decode_row(args.decode_batch, args.repeats, rng))
    print_table(rows)


if __name__ == "__main__":
    main()
