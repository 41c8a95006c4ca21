"""How much of the fp32 tolerance the plain-JAX `chunk_kda` uses, against the float64 token recurrence.

For each decay regime of the kernel tests (`tests/kda_impl/kernel_inputs.py`: realistic, strong: g
down to -60 per token, mixed: strong and near-zero decays interleaved) and each shape (a packed batch
with empty, partial, whole and multi-chunk sequences; one long sequence at the real head size), the
kernel runs on fp32 inputs and `kda_spec.truth.packed_delta_rule` on the same inputs in float64. A cell
is the worst `|x - truth| / (atol + rtol * |truth|)` over o and the final states, with the tests'
atol = rtol = 1e-5: below 1 passes, and 0.05 means 5% of the tolerance used. Run it before and after
a kernel change.

    python -m benchmarks.chunk_margins [--seeds 3]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from kda_impl.kernels import naive
from kda_spec.truth import packed_delta_rule
from tests.kda_impl.kernel_inputs import l2normalise, random_kernel_inputs

ATOL = RTOL = 1e-5
DECAYS = ("realistic", "strong", "mixed")
SHAPES = {
    "packed [3,0,64,65,130] H=2 D=32": ([3, 0, 64, 65, 130], 2, 32),
    "one sequence T=1000 H=2 D=128": ([1000], 2, 128),
}


def worst_ratio(lengths: list[int], heads: int, dim: int, decay: str, seed: int) -> float:
    """The worst error-to-tolerance ratio of `chunk_kda` on one packed batch of `lengths` tokens."""
    rng = np.random.default_rng(seed)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = random_kernel_inputs(rng, int(cu_seqlens[-1]), heads=heads, dim=dim, decay=decay)
    q, k = (l2normalise(inputs[name])[0] for name in ("q", "k"))
    v, g, beta = (inputs[name][0] for name in ("v", "g", "beta"))
    h0 = rng.standard_normal((len(lengths), heads, dim, dim)).astype(np.float32)
    o, state = naive.chunk_kda(
        *(jnp.asarray(x)[None] for x in (q, k, v, g, beta)),
        initial_state=jnp.asarray(h0),
        output_final_state=True,
        cu_seqlens=jnp.asarray(cu_seqlens),
    )
    q64, k64, v64, g64, beta64, h064 = (x.astype(np.float64) for x in (q, k, v, g, beta, h0))
    truth_o, truth_state = packed_delta_rule(q64, k64, v64, g64, beta64, cu_seqlens, h064)
    ratios = [
        np.max(np.abs(np.asarray(x, np.float64) - t) / (ATOL + RTOL * np.abs(t)))
        for x, t in ((np.asarray(o)[0], truth_o), (np.asarray(state), truth_state))
    ]
    return float(max(ratios))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell; the cell is the worst")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    print(f"worst |chunk_kda - float64| / ({ATOL:g} + {RTOL:g}|truth|) over o and states, {args.seeds} seeds")
    print(f"| shape | {' | '.join(DECAYS)} |\n|---|{'---|' * len(DECAYS)}")
    for name, (lengths, heads, dim) in SHAPES.items():
        cells = [max(worst_ratio(lengths, heads, dim, d, s) for s in range(args.seeds)) for d in DECAYS]
        print(f"| {name} | {' | '.join(f'{c:.3f}' for c in cells)} |", flush=True)


if __name__ == "__main__":
    main()
