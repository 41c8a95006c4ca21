"""fla's `chunk_kda` against the project's plain-JAX `chunk_kda`, one sequence of T tokens (device_check.sh).

On `--device cuda`: fla's Triton kernel (torch) and the plain-JAX kernel (jitted, on JAX's default GPU
backend). On `--device cpu` (the script's `--cpu-smoke`): fla-core's torch `naive_chunk_kda` and the
plain-JAX kernel on the CPU, at tiny sizes, to test the plumbing. Each time is the median of a few calls
after one warm-up (the warm-up's time, compile and autotune included, is reported as "first call").
Writes a JSON file and prints a table; a size that fails is reported with its error, not fatal.

    python -m benchmarks.device_timing --device cuda --heads 32 --dim 128 --tokens 1024 8192 32768 \
        --out timing.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kda_impl.kernels import naive

DTYPES = {"fp32": (torch.float32, jnp.float32), "bf16": (torch.bfloat16, jnp.bfloat16)}


def timed(fn: Callable[[], Any], sync: Callable[[Any], None], repeats: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of `repeats` further calls)."""
    start = time.perf_counter()
    sync(fn())
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(fn())
        runs.append(time.perf_counter() - start)
    return first, statistics.median(runs)


def kernel_inputs(tokens: int, heads: int, dim: int, seed: int = 0) -> list[np.ndarray]:
    """q, k (unit rows), v, g (log decay), beta for one sequence, float32."""
    rng = np.random.default_rng(seed)
    shape = (1, tokens, heads, dim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.exp(rng.uniform(-5.0, 0.5, size=shape)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=shape[:3]).astype(np.float32)
    return [q, k, v, g, beta]


def fla_chunk(device: str) -> tuple[str, Callable[..., Any]]:
    if device == "cuda":
        from fla.ops.kda import chunk_kda

        return "fla chunk_kda (Triton)", functools.partial(chunk_kda, output_final_state=True)
    from fla.ops.kda.naive import naive_chunk_kda

    return "fla naive_chunk_kda (torch)", functools.partial(naive_chunk_kda, output_final_state=True)


def fla_row(device: str, inputs: list[np.ndarray], dtype: str, repeats: int) -> dict[str, Any]:
    name, kernel = fla_chunk(device)
    torch_dtype = DTYPES[dtype][0]
    # g and beta stay fp32 as a serving stack passes them; q, k, v in the run dtype.
    tensors = [
        torch.from_numpy(x).to(device, torch_dtype if i < 3 else torch.float32) for i, x in enumerate(inputs)
    ]

    def sync(_: Any) -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        first, median = timed(lambda: kernel(*tensors), sync, repeats)
    return {"kernel": name, "first_s": first, "median_s": median}


def jax_row(inputs: list[np.ndarray], dtype: str, repeats: int) -> dict[str, Any]:
    jax_dtype = DTYPES[dtype][1]
    args = [jnp.asarray(x, jax_dtype if i < 3 else jnp.float32) for i, x in enumerate(inputs)]
    jitted = jax.jit(functools.partial(naive.chunk_kda, output_final_state=True))
    first, median = timed(lambda: jitted(*args), jax.block_until_ready, repeats)
    return {
        "kernel": f"jax chunk_kda (plain JAX, {jax.default_backend()})",
        "first_s": first,
        "median_s": median,
    }


def measure(
    device: str, heads: int, dim: int, tokens: list[int], dtypes: list[str], repeats: int
) -> list[dict]:
    rows = []
    for count in tokens:
        inputs = kernel_inputs(count, heads, dim)
        for dtype in dtypes:
            for side in ("fla", "jax"):
                base = {"T": count, "H": heads, "D": dim, "dtype": dtype}
                try:
                    if side == "fla":
                        row = fla_row(device, inputs, dtype, repeats)
                    else:
                        row = jax_row(inputs, dtype, repeats)
                    rows.append({**base, **row})
                except Exception as err:  # a size that does not fit or fails: reported, the rest still run
                    rows.append({**base, "kernel": side, "error": f"{type(err).__name__}: {err}"[:300]})
                print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    head = f"{row['kernel']:44s} T={row['T']:<6d} H={row['H']} D={row['D']} {row['dtype']}"
    if "error" in row:
        return f"{head}  FAILED: {row['error']}"
    return f"{head}  first {row['first_s']:8.3f} s  median {1e3 * row['median_s']:10.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if args.device == "cpu" and any(count % 64 for count in args.tokens):
        parser.error(f"--device cpu times naive_chunk_kda, which takes whole 64-token chunks: {args.tokens}")
    rows = measure(args.device, args.heads, args.dim, args.tokens, args.dtypes, args.repeats)
    environment = {
        "torch": torch.__version__,
        "jax": jax.__version__,
        "jax_devices": [str(device) for device in jax.devices()],
        "torch_device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }
    args.out.write_text(json.dumps({"environment": environment, "rows": rows}, indent=1))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
