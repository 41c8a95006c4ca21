"""`make bench`: one decode step of the plain-JAX `decode_kda_slots`, against the former gather-step-scatter.

B requests (default 64) on distinct random slots of a `[2B + 1, H=32, K=128, V=128]` fp32 state buffer,
jitted with the buffer donated and the slot indices passed as an argument, as the serving loop calls it.
Both implementations run in this one process, interleaved, each timed `--repeats` times (the table shows
the minimum, and the ratio of the minima, of wall time and of this process's CPU time, user + sys): on a
shared machine only the ratios are meaningful. The table
also counts, in each compiled HLO, copies of the whole state buffer and arrays of the batch's states'
size (`[B, H, K, V]` temporaries): the in-place kernel has neither.

    python -m benchmarks.bench_decode [--batch 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels import naive
from kda_impl.kernels.common import prepare_inputs
from kda_impl.kernels.recurrent import recurrent_step
from kda_impl.kernels.slots import route_unsafe_slots_to_dummy

HEADS, DIM = 32, 128
DecodeStep = Callable[..., tuple[jax.Array, jax.Array]]

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*\w+\[([\d,]*)\](?:\{[^}]*\})?\s+([\w-]+)\(")
_FUSION_BODY = re.compile(r"\sfusion\(.*\bcalls=(%[\w.-]+)")
_NOT_STORAGE = {"bitcast", "parameter", "get-tuple-element", "tuple", "constant"}


def materialised_arrays(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(opcode, shape) of every array a compiled HLO module stores: its instructions outside fused
    computations (whose insides live in registers), less bitcasts, parameters, tuples and constants."""
    fused = set(_FUSION_BODY.findall(hlo_text))
    arrays = []
    in_fused_computation = False
    for line in hlo_text.splitlines():
        if line.startswith("%") or line.startswith("ENTRY "):  # a computation's header
            in_fused_computation = line.split()[0] in fused
            continue
        match = _INSTRUCTION.match(line)
        if match and not in_fused_computation and match.group(2) not in _NOT_STORAGE:
            shape = tuple(int(d) for d in match.group(1).split(",") if d)
            arrays.append((match.group(2), shape))
    return arrays


def gather_step_scatter_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    state_buffer: jax.Array,  # [S, H, K, V]
    slot_indices: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The plain-JAX decode as it was before this benchmark: gather the B states, step, scatter back."""
    slots = route_unsafe_slots_to_dummy(slot_indices, state_buffer.shape[0])
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, None, False)
    states, o = recurrent_step(state_buffer[slots], q * scale, k, v, g, beta)
    return o, state_buffer.at[slots].set(states)


def decode_inputs(batch: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(state buffer [2B + 1, H, K, V], slot indices i32[B], [q, k, v, g, beta]) with normalised q, k."""
    slots = 2 * batch + 1
    buffer = (0.1 * rng.standard_normal((slots, HEADS, DIM, DIM))).astype(np.float32)
    shape = (batch, HEADS, DIM)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    g = -np.exp(rng.uniform(-5.0, 0.5, size=shape)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=shape[:2]).astype(np.float32)
    indices = rng.permutation(np.arange(1, slots))[:batch].astype(np.int32)
    return buffer, indices, [q, k, v, g, beta]


def compiled_step(decode: DecodeStep, buffer: jax.Array, slots: jax.Array, inputs: list[jax.Array]):
    """`decode` compiled as the serving loop calls it: the state buffer donated, the slots an argument."""
    step = jax.jit(
        lambda buffer, slots, *xs: decode(*xs, state_buffer=buffer, slot_indices=slots),
        donate_argnums=0,
    )
    return step.lower(buffer, slots, *inputs).compile()


def hlo_counts(hlo_text: str, buffer_shape: tuple[int, ...], batch: int) -> tuple[int, int]:
    """(copies of the whole state buffer, arrays of the B states' size) a compiled HLO module stores."""
    arrays = materialised_arrays(hlo_text)
    copies = sum(op == "copy" and shape == buffer_shape for op, shape in arrays)
    state_size = batch * math.prod(buffer_shape[1:])
    return copies, sum(math.prod(shape) == state_size for _, shape in arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    buffer, indices, xs = decode_inputs(args.batch, np.random.default_rng(0))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}: decode_kda_slots, batch {args.batch} of")
    print(f"{buffer.shape[0]} slots, H={HEADS}, K=V={DIM}, fp32, buffer donated; min of {args.repeats}\n")
    contenders = {
        "before: gather, step, scatter": gather_step_scatter_decode,
        "after: naive.decode_kda_slots (in place)": naive.decode_kda_slots,
    }
    slots, inputs = jnp.asarray(indices), [jnp.asarray(x) for x in xs]
    buffers = {name: jnp.asarray(buffer) for name in contenders}
    steps = {name: compiled_step(decode, buffers[name], slots, inputs) for name, decode in contenders.items()}
    outputs = {}
    for name, step in steps.items():  # a warm-up call, and the outputs to compare
        outputs[name], buffers[name] = step(buffers[name], slots, *inputs)
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            _, buffers[name] = jax.block_until_ready(step(buffers[name], slots, *inputs))
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    baseline = next(iter(contenders))
    header = (
        f"{'implementation':42s} {'wall min':>9s} {'speed-up':>9s} {'CPU min':>9s} {'speed-up':>9s} "
        f"{'buffer copies':>14s} {'B-state temps':>14s}"
    )
    print(header)
    print("-" * len(header))
    for name, step in steps.items():
        copies, temporaries = hlo_counts(step.as_text(), buffer.shape, args.batch)
        wall_ratio, cpu_ratio = min(wall[baseline]) / min(wall[name]), min(cpu[baseline]) / min(cpu[name])
        print(
            f"{name:42s} {1e3 * min(wall[name]):7.1f}ms {wall_ratio:8.2f}x {1e3 * min(cpu[name]):7.1f}ms "
            f"{cpu_ratio:8.2f}x {copies:14d} {temporaries:14d}"
        )
    before, after = (np.asarray(o) for o in outputs.values())
    print(f"\nmax |o after - o before| = {np.max(np.abs(after - before)):.2e}")


if __name__ == "__main__":
    main()
