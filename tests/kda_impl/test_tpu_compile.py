"""The Pallas kernels lowered and compiled for TPU on a machine without one: the Pallas → Mosaic
lowering of every entry point (`jax.export`), and with libtpu (`make test` installs it into
`.venv/libtpu`, named by `$KDA_LIBTPU_PATH`) the full deviceless AOT compile for two TPU generations.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kda_impl.kernels import pallas
from kda_spec.config import get_preset

LIBTPU_ENV = "KDA_LIBTPU_PATH"  # a directory holding the `libtpu` package (pip install --target DIR libtpu)
TOPOLOGIES = ("v5e:2x2", "v6e:2x2")


def tpu_entry_points(
    heads: int = 4,
    dim: int = 128,
    tokens: int = 256,
    seqs: int = 3,
    requests: int = 5,
    slots: int = 9,
    dtype=jnp.float32,
):
    """Each public kernel as `(name, jitted fn, abstract args)`, with packed batches and initial states;
    q, k, v in `dtype` (the layer's run dtype), g, beta and the states fp32, as the layer calls them."""
    f32 = jnp.float32
    sds = jax.ShapeDtypeStruct
    tokens_in = [sds((1, tokens, heads, dim), dtype)] * 3 + [
        sds((1, tokens, heads, dim), f32),
        sds((1, tokens, heads), f32),
    ]
    packed = [sds((seqs, heads, dim, dim), f32), sds((seqs + 1,), jnp.int32)]
    decode_in = [sds((requests, heads, dim), dtype)] * 3 + [
        sds((requests, heads, dim), f32),
        sds((requests, heads), f32),
    ]

    def prefill(kernel, **kwargs):
        def fn(q, k, v, g, beta, initial_state, cu_seqlens, *gate):
            gate_kwargs = dict(zip(("A_log", "dt_bias"), gate))
            return kernel(
                q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=True,
                interpret=False, **kwargs, **gate_kwargs,
            )  # fmt: skip

        return jax.jit(fn)

    def decode(q, k, v, g, beta, state_buffer, slot_indices, layer_index):
        return pallas.decode_kda_slots(
            q, k, v, g, beta, state_buffer=state_buffer, slot_indices=slot_indices, layer_index=layer_index,
            interpret=False,
        )  # fmt: skip

    gate = [sds((heads,), f32), sds((heads * dim,), f32)]
    # fla's options: GVA (q, k on half the heads), the lower-bound gate, beta logits, v-first states and
    # the intermediate states (an extra output of the kernel); a v-first decode pool.
    gva_in = [sds((1, tokens, heads // 2, dim), dtype)] * 2 + tokens_in[2:]
    fla_options = {
        "use_gate_in_kernel": True,
        "safe_gate": True,
        "lower_bound": -5.0,
        "use_beta_sigmoid_in_kernel": True,
        "allow_neg_eigval": True,
        "state_v_first": True,
        "return_intermediate_states": True,
    }

    def decode_v_first(q, k, v, g, beta, state_buffer, slot_indices, layer_index):
        return pallas.decode_kda_slots(
            q, k, v, g, beta, state_buffer=state_buffer, slot_indices=slot_indices, layer_index=layer_index,
            state_v_first=True, interpret=False,
        )  # fmt: skip

    return [
        ("chunk", prefill(pallas.chunk_kda, use_qk_l2norm_in_kernel=True), tokens_in + packed),
        ("chunk+gate", prefill(pallas.chunk_kda, use_gate_in_kernel=True), tokens_in + packed + gate),
        ("recurrent", prefill(pallas.fused_recurrent_kda), tokens_in + packed),
        (
            "decode",
            jax.jit(decode, donate_argnums=5),
            [
                *decode_in,
                sds((3, slots, heads, dim, dim), f32),
                sds((requests,), jnp.int32),
                sds((), jnp.int32),
            ],
        ),
        ("chunk+fla-options", prefill(pallas.chunk_kda, **fla_options), gva_in + packed + gate),
        (
            "decode+v-first",
            jax.jit(decode_v_first, donate_argnums=5),
            [
                *decode_in,
                sds((3, slots, heads, dim, dim), f32),
                sds((requests,), jnp.int32),
                sds((), jnp.int32),
            ],
        ),
    ]


@pytest.mark.parametrize("entry", range(6), ids=[name for name, *_ in tpu_entry_points()])
def test_lowers_for_tpu(entry):
    """Pallas → Mosaic lowering for TPU (`jax.export`, no TPU needed); decode aliases the pool in place."""
    name, fn, args = tpu_entry_points()[entry]
    module = jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in module
    if name.startswith("decode"):
        assert "output_operand_aliases" in module  # the pool buffer is the kernel's output, in place


def _libtpu_path() -> str | None:
    if os.environ.get(LIBTPU_ENV):
        return os.environ[LIBTPU_ENV]
    spec = importlib.util.find_spec("libtpu")
    return None if spec is None else os.path.dirname(os.path.dirname(spec.origin))


@pytest.mark.skipif(
    _libtpu_path() is None,
    reason=f"needs libtpu (the TPU compiler) to compile for TPU without one: `make test` installs it, "
    f"or `pip install --target DIR -c constraints.txt libtpu`, then set {LIBTPU_ENV}=DIR",
)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_compiles_for_tpu(topology: str):
    """The full Mosaic compile (layouts, VMEM budget) of every entry point, fp32 and bf16, at the real
    preset's heads, for a TPU generation, deviceless, in a subprocess so that this process never loads
    the TPU plugin."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_libtpu_path(), str(repo)])}
    script = "import sys; from tests.kda_impl import test_tpu_compile as t; t.compile_for_tpu(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", script, topology],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("compiled") == 12, done.stdout


def compile_for_tpu(topology: str) -> None:
    """AOT-compile every entry point in fp32 and bf16, at the heads of the real preset, for a TPU
    topology on a machine without TPUs (needs libtpu)."""
    from jax.experimental import topologies as tpu_topologies

    real = get_preset("kimi-linear-48b-a3b")
    device = tpu_topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, fn, args in tpu_entry_points(heads=real.num_heads, dim=real.head_dim, dtype=dtype):
            placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
            fn.trace(*placed).lower().compile()
            print(f"compiled {name} ({jnp.dtype(dtype).name}) for {topology}")
