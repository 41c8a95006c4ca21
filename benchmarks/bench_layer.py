"""`make bench`, the layer: the whole KDA layer served through its pool, unsharded and tensor-parallel,
and against transformers' torch layer, on this machine.

At the real size (`kimi-linear-48b-a3b`: hidden 2304, H=32, D=128), fp32, plain-JAX kernels off TPU:
one prefill of T tokens and one decode step for a batch of requests, on meshes of `--tp` tensor ranks
(8 CPU devices are made when JAX runs on a CPU, so TP=4 runs on 4 of them — on a CPU host the devices
share its cores, so this measures the overhead of splitting, not a speed-up); then the same prefill in
transformers' `KimiLinearDeltaAttention` on its pure-torch kernels. Times: median of `--repeats` calls
after the first (trace + compile + run). Not a test: numbers for orientation, printed as a table.

    python -m benchmarks.bench_layer [--tokens 1024] [--decode-batch 64] [--tp 1 4] [--repeats 3] [--no-torch]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_kernels import timed
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode, make_forward_batch
from kda_impl.models.kimi_linear import jit_forward
from kda_impl.parallel import make_mesh
from kda_impl.weights import layer_from_hf_weights
from kda_spec.config import KDAConfig, get_preset
from kda_spec.synthetic_weights import synthetic_weights

HOST_DEVICES = 8
Row = tuple[str, str, float, float]  # what, mesh, first call (s), median (s)


def layer_rows(
    config: KDAConfig, weights: dict[str, np.ndarray], tp: int, tokens: int, decode_batch: int, repeats: int
) -> list[Row]:
    """Prefill of one `tokens`-long request and one decode step of `decode_batch` requests on TP=`tp`."""
    mesh = make_mesh(tp=tp)
    step = jit_forward(layer_from_hf_weights(config, 0, weights, jnp.float32, mesh))
    pool = RecurrentStatePool.create(config, decode_batch, jnp.float32, layer_ids=(0,), mesh=mesh)
    backend = KDAAttnBackend()
    rng = np.random.default_rng(0)
    state = {"pool": pool}

    def timed_step(mode: ForwardMode, seq_lens: list[int], slots: np.ndarray) -> tuple[float, float]:
        pool = state["pool"]
        batch = make_forward_batch(
            backend, mode, seq_lens, pool.get_recurrent_indices(slots), num_slots=pool.num_slots
        )
        hidden = rng.standard_normal((batch.num_tokens, config.hidden_size)).astype(np.float32)

        def run() -> jax.Array:
            out, state["pool"] = step(hidden, batch, state["pool"])
            return out

        return timed(run, repeats)

    slots = state["pool"].alloc(decode_batch)
    prefill = timed_step(ForwardMode.EXTEND, [tokens], slots[:1])
    decode = timed_step(ForwardMode.DECODE, [1] * decode_batch, slots)
    kernel = backend.kernel_used
    return [
        (f"jax layer prefill T={tokens} ({kernel})", f"TP={tp}", *prefill),
        (f"jax layer decode step, batch {decode_batch} ({kernel})", f"TP={tp}", *decode),
    ]


def torch_row(config: KDAConfig, weights: dict[str, np.ndarray], tokens: int, repeats: int) -> list[Row]:
    """The same prefill in transformers' `KimiLinearDeltaAttention` on its pure-torch kernels."""
    try:
        import torch
        from transformers.models.kimi_linear import modeling_kimi_linear as modeling

        from dump_gen.capture import replaced
        from dump_gen.references.transformers_layer import TransformersReference
    except ImportError as err:
        print(f"(transformers reference skipped: {err})")
        return []
    layer = TransformersReference(config, "cpu").build(weights, torch.float32).layer
    rng = np.random.default_rng(0)
    hidden = torch.from_numpy(rng.standard_normal((1, tokens, config.hidden_size)).astype(np.float32))
    name = "chunk_kimi_delta_attention"  # fla's Triton kernel unless replaced by its pure-torch version
    pure = getattr(getattr(modeling, name), "__wrapped__", getattr(modeling, name))
    with replaced(modeling, name, pure), torch.inference_mode():
        first, median = timed(lambda: layer(hidden), repeats)
    return [(f"transformers layer prefill T={tokens} (torch {torch.__version__})", "-", first, median)]


def print_table(rows: list[Row]) -> None:
    header = f"{'what':58s} {'mesh':>6s} {'first call':>12s} {'median':>12s}"
    print(header)
    print("-" * len(header))
    for what, mesh, first, median in rows:
        print(f"{what:58s} {mesh:>6s} {first:11.2f}s {1e3 * median:10.1f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-linear-48b-a3b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers reference")
    args = parser.parse_args()
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", HOST_DEVICES)  # only affects JAX's CPU devices

    config = get_preset(args.preset)
    weights = synthetic_weights(config, seed=0)
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; {config.preset}: "
        f"hidden {config.hidden_size}, H={config.num_heads}, D={config.head_dim}, fp32\n"
    )
    rows = []
    for tp in args.tp:
        rows += layer_rows(config, weights, tp, args.tokens, args.decode_batch, args.repeats)
    if not args.no_torch:
        rows += torch_row(config, weights, args.tokens, args.repeats)
    print_table(rows)


if __name__ == "__main__":
    main()
