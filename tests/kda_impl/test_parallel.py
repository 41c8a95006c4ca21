"""Tensor and data parallelism: every mesh of 8 CPU devices — TP in {1, 2, 4, 8} and TP=4 x DP=2 with
the plain-JAX kernels, TP=2 x DP=2 with the Pallas ones — gives the unsharded result (fp32,
atol = rtol = 1e-5) for prefill, decode and prefill → decode; the layout of parameters and pool; the
conformance suite under a mesh; the errors.

The meshes run in one worker process with 8 CPU devices (`parallel_scenario.launch`), so that this
session keeps its own devices; the reference runs here, on one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode, make_dp_forward_batch, make_forward_batch
from kda_impl.models.kimi_linear import KimiDeltaAttention
from kda_impl.parallel import MESH_AXES, make_mesh
from tests.kda_impl.parallel_scenario import (
    CONFIG,
    NUM_SLOTS,
    REPO_ROOT,
    assert_matches_single_device,
    launch,
    parse_mesh,
)

# TPxDP[:kernel]; the Pallas kernels (interpret mode here) are what a TPU runs under the mesh.
MESHES = ("1x1", "2x1", "4x1", "8x1", "4x2", "2x2:pallas")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    return launch(
        tmp_path_factory.mktemp("meshes"), MESHES, num_processes=1, devices_per_process=8, timeout_s=TIMEOUT_S
    )


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_gives_the_unsharded_result(mesh, mesh_results):
    assert_matches_single_device(mesh_results[mesh])


@pytest.mark.parametrize("mesh", ["4x1", "4x2"])
def test_parameters_and_pool_are_split_along_heads_and_slots(mesh, mesh_results):
    result = mesh_results[mesh]
    tp, _, _ = parse_mesh(mesh)
    heads, dim, hidden, width = CONFIG.num_heads, CONFIG.head_dim, CONFIG.hidden_size, CONFIG.conv_size
    proj = heads * dim
    expected = {
        "q_proj.kernel": (hidden, proj // tp),
        "k_proj.kernel": (hidden, proj // tp),
        "v_proj.kernel": (hidden, proj // tp),
        "q_conv1d": (width, proj // tp),
        "k_conv1d": (width, proj // tp),
        "v_conv1d": (width, proj // tp),
        "f_a_proj.kernel": (hidden, dim),
        "f_b_proj.kernel": (dim, proj // tp),
        "A_log": (heads // tp,),
        "dt_bias": (heads // tp, dim),
        "b_proj.kernel": (hidden, heads // tp),
        "g_a_proj.kernel": (hidden, dim),
        "g_b_proj.kernel": (dim, proj // tp),
        "o_norm.weight": (dim,),
        "o_proj.kernel": (proj // tp, hidden),
        # Each data rank holds its own NUM_SLOTS slots and dummy slot.
        "pool.recurrent": (1, NUM_SLOTS + 1, heads // tp, dim, dim),
        "pool.conv": (1, NUM_SLOTS + 1, width - 1, 3, proj // tp),
    }
    shards = {
        key.removeprefix("shard."): tuple(value) for key, value in result.items() if key.startswith("shard.")
    }
    assert shards == expected
    assert result["laid_out.pool.recurrent"] and result["laid_out.pool.conv"]
    assert result["donated"], "decode consumed the pool it was given (updated in place)"


def test_conformance_runs_under_a_mesh_and_records_it(tmp_path):
    """Two golden cases (one of four sequences with initial states, decoded) at TP=2 x DP=2."""
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    command = [
        sys.executable, "-m", "conformance", "run", "--dumps", "golden", "--dtypes", "fp32",
        "--cases", "T65", "varlen_initstate", "--tp", "2", "--dp", "2", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    mesh = report["implementation"]["describe"]["fp32"]["mesh"]
    assert mesh == {"tp": 2, "dp": 2, "devices": 4, "processes": 1}


def test_a_head_count_the_tensor_axis_does_not_divide_is_refused():
    mesh = AbstractMesh((1, 3), MESH_AXES)  # the check needs the axis sizes only
    message = r"num_heads=8 cannot be split over a tensor axis of size tp=3: .*\(one of \[1, 2, 4, 8\]\)"
    with pytest.raises(ValueError, match=message):
        KimiDeltaAttention(CONFIG, 0, mesh, jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        RecurrentStatePool.create(CONFIG, 4, layer_ids=(0,), mesh=mesh)


def test_a_mesh_larger_than_the_devices_is_refused():
    with pytest.raises(ValueError, match=r"tp=16 x dp=2 needs 32 devices, found \d+ .*device_count=32"):
        make_mesh(tp=16, dp=2)


def test_a_batch_or_pool_for_another_data_axis_is_refused():
    layer = KimiDeltaAttention(CONFIG, 0, AbstractMesh((2, 1), MESH_AXES), jnp.float32, rngs=nnx.Rngs(0))
    pool = RecurrentStatePool.create(CONFIG, 4, layer_ids=(0,))
    backend = KDAAttnBackend(kernel="naive")
    batch = make_forward_batch(backend, ForwardMode.DECODE, [1], pool.alloc(1), num_slots=pool.num_slots)
    hidden = np.zeros((batch.num_tokens, CONFIG.hidden_size), np.float32)
    with pytest.raises(
        ValueError, match=r"dp=2 data ranks, but the batch has dp_size=1 and the pool dp_size=1"
    ):
        layer(hidden, batch.positions, batch, pool)
    with pytest.raises(ValueError, match=r"data rank 1: seq_lens must be a 1-D list"):
        make_dp_forward_batch(backend, ForwardMode.EXTEND, [[3], [[1, 2]]], [[1], [[1, 2]]], num_slots=4)
    with pytest.raises(ValueError, match=r"dp_rank=1 is not a data rank of this pool \(it has 1\)"):
        pool.alloc(1, dp_rank=1)
