"""One serving scenario that runs on any mesh, and the worker processes that run it on CPU meshes.

Four requests of uneven lengths (one past the 64-token chunk, one of a single token) are prefilled in one
packed EXTEND step, then decoded `DECODE_STEPS` tokens in place in the pool, then prefilled again whole
(prompt + the decoded tokens) in fresh slots. The data ranks take the requests round-robin. Every
result comes back in request order, so that any two meshes compare element by element.

The meshes run in worker processes with their own CPU devices (this test session keeps its single
device): `launch` starts them, each running

    python -m tests.kda_impl.parallel_scenario --num-processes P --process-id I --devices-per-process D \\
        [--coordinator 127.0.0.1:PORT] --mesh 8x1 --mesh 4x2 --out DIR

(every process runs the same program on its share of the mesh; a mesh `TPxDP:pallas` runs the Pallas
kernels, in interpret mode off TPU); process 0 writes one `.npz` per mesh into DIR.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from conformance.runtime.cpu_compile import prefer_fast_cpu_compile
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import CONV_SPEC, RECURRENT_SPEC, RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode, make_dp_forward_batch
from kda_impl.models.kimi_linear import jit_forward
from kda_impl.parallel import fetch, make_mesh, mesh_sizes, single_device_mesh
from kda_impl.weights import layer_from_hf_weights
from kda_spec.config import KDAConfig
from kda_spec.synthetic_weights import synthetic_weights
from tests.kda_impl.conftest import assert_close

CONFIG = KDAConfig(hidden_size=64, num_heads=8, head_dim=32, preset="parallel-test", kda_layers=(1,))
LENGTHS = (37, 5, 90, 1)
DECODE_STEPS = 3
TOKEN_BUCKET = 256  # prompts and whole sequences alike fit one bucket: one EXTEND compilation
NUM_SLOTS = 8
# Results compared across meshes; the other entries of a result describe the layout.
RESULTS = ("prefill", "decode", "decode_recurrent", "decode_conv", "whole", "whole_recurrent", "whole_conv")
REPO_ROOT = Path(__file__).resolve().parents[2]


def scenario_inputs() -> tuple[list[np.ndarray], np.ndarray]:
    """`(prompts [L_i, hidden] per request, decode tokens [DECODE_STEPS, N, hidden])`, float32."""
    rng = np.random.default_rng(0)
    prompts = [rng.standard_normal((n, CONFIG.hidden_size)).astype(np.float32) for n in LENGTHS]
    decode = rng.standard_normal((DECODE_STEPS, len(LENGTHS), CONFIG.hidden_size)).astype(np.float32)
    return prompts, decode


class MeshRunner:
    """The layer, its pool and a jitted forward on `mesh`; requests dealt round-robin to the data ranks."""

    def __init__(self, mesh: Mesh, num_requests: int, kernel: str = "naive"):
        dp, _ = mesh_sizes(mesh)
        self.mesh = mesh
        self.layer = layer_from_hf_weights(CONFIG, 0, synthetic_weights(CONFIG, seed=0), jnp.float32, mesh)
        self.forward = jit_forward(self.layer)
        self.pool = RecurrentStatePool.create(CONFIG, NUM_SLOTS, jnp.float32, layer_ids=(0,), mesh=mesh)
        self.backend = KDAAttnBackend(kernel=kernel)
        self.ranks = [list(range(rank, num_requests, dp)) for rank in range(dp)]

    def alloc(self) -> list[np.ndarray]:
        """Fresh slots for every request: one array of slots per data rank."""
        return [self.pool.alloc(len(requests), rank) for rank, requests in enumerate(self.ranks)]

    def step(self, mode: ForwardMode, xs: Sequence[np.ndarray], slots: list[np.ndarray]) -> list[np.ndarray]:
        """One forward of the requests' tokens `xs[i]` `[L_i, hidden]`: their outputs, in request order."""
        seq_lens = [[len(xs[i]) for i in requests] for requests in self.ranks]
        indices = [self.pool.get_recurrent_indices(rank_slots, rank) for rank, rank_slots in enumerate(slots)]
        batch = make_dp_forward_batch(
            self.backend, mode, seq_lens, indices, num_slots=self.pool.num_slots, min_tokens=TOKEN_BUCKET
        )
        hidden = np.zeros((batch.num_tokens, CONFIG.hidden_size), np.float32)
        rows = {}
        for rank, requests in enumerate(self.ranks):
            for i, request_rows in zip(requests, batch.request_rows(rank, seq_lens[rank])):
                rows[i] = request_rows
                hidden[request_rows] = xs[i]
        out, self.pool = self.forward(hidden, batch, self.pool)
        out = fetch(out)
        return [out[rows[i]] for i in range(len(xs))]

    def states(self, slots: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """`(recurrent [N, H, D, D], conv [N, W-1, 3, P])` of the requests' slots, in request order."""
        rows = np.empty(sum(len(requests) for requests in self.ranks), np.int32)
        for rank, requests in enumerate(self.ranks):
            rows[requests] = self.pool.rows(slots[rank], rank)
        recurrent, conv = self.pool.get_linear_recurrent_layer_cache(0)
        return fetch(recurrent[rows]), fetch(conv[rows])

    def layout(self) -> dict[str, np.ndarray]:
        """The shape of the first device's share of every parameter and buffer, and whether the pool
        still has its layout."""
        _, params = nnx.split(self.layer)
        facts = {
            f"shard.{'.'.join(str(key.key) for key in path[:-1])}": np.asarray(
                leaf.addressable_shards[0].data.shape
            )
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        for name, buffer, spec in (
            ("recurrent", self.pool.recurrent_buffer, RECURRENT_SPEC),
            ("conv", self.pool.conv_buffer, CONV_SPEC),
        ):
            facts[f"shard.pool.{name}"] = np.asarray(buffer.addressable_shards[0].data.shape)
            facts[f"laid_out.pool.{name}"] = np.asarray(
                buffer.sharding.is_equivalent_to(NamedSharding(self.mesh, spec), buffer.ndim)
            )
        return facts


def run_scenario(mesh: Mesh, kernel: str = "naive") -> dict[str, np.ndarray]:
    """The scenario on `mesh`: outputs and states of the prefill, the decode steps and the whole prefill
    (`RESULTS`), the layout after them, and whether each decode step consumed the pool it was given."""
    prompts, decode_tokens = scenario_inputs()
    runner = MeshRunner(mesh, len(prompts), kernel)
    slots = runner.alloc()
    result = {"prefill": np.concatenate(runner.step(ForwardMode.EXTEND, prompts, slots))}
    decoded, donated = [], []
    for tokens in decode_tokens:
        before = runner.pool
        decoded.append(np.concatenate(runner.step(ForwardMode.DECODE, list(tokens[:, None]), slots)))
        donated.append(before.recurrent_buffer.is_deleted() and before.conv_buffer.is_deleted())
    result["decode"] = np.stack(decoded)  # [steps, N, hidden]
    result["donated"] = np.asarray(all(donated))
    result["decode_recurrent"], result["decode_conv"] = runner.states(slots)

    whole = [np.concatenate([prompt, decode_tokens[:, i]]) for i, prompt in enumerate(prompts)]
    fresh = runner.alloc()
    result["whole"] = np.concatenate(runner.step(ForwardMode.EXTEND, whole, fresh))
    result["whole_recurrent"], result["whole_conv"] = runner.states(fresh)
    return result | runner.layout()


@functools.cache
def single_device_result() -> dict[str, np.ndarray]:
    """The scenario unsharded, in this process: the reference of every mesh."""
    return run_scenario(single_device_mesh())


def assert_matches_single_device(result: dict[str, np.ndarray]) -> None:
    """Every result of the scenario equals the unsharded one (fp32, atol = rtol = 1e-5), and the decoded
    tokens and their states equal the whole prefill's (prefill → decode, across meshes)."""
    expected = single_device_result()
    for name in RESULTS:
        try:
            assert_close(result[name], expected[name])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    steps = result["decode"].shape[0]
    starts = np.cumsum([0, *LENGTHS[:-1]]) + np.arange(len(LENGTHS)) * steps  # of each whole sequence
    for i, start in enumerate(starts):
        assert_close(result["decode"][:, i], expected["whole"][start + LENGTHS[i] + np.arange(steps)])
    assert_close(result["decode_recurrent"], expected["whole_recurrent"])
    assert_close(result["decode_conv"], expected["whole_conv"])


def free_port() -> int:
    """A TCP port of the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_mesh(text: str) -> tuple[int, int, str]:
    """`"TPxDP[:kernel]"` → `(tp, dp, kernel)`; the kernel defaults to plain JAX."""
    sizes, _, kernel = text.partition(":")
    tp, dp = (int(size) for size in sizes.split("x"))
    return tp, dp, kernel or "naive"


def _result_file(out: Path, mesh: str) -> Path:
    return out / f"{mesh.replace(':', '_')}.npz"


def launch(
    out: Path, meshes: Sequence[str], num_processes: int, devices_per_process: int, timeout_s: float
) -> dict[str, dict[str, np.ndarray]]:
    """Run the scenario on `meshes` ("TPxDP[:kernel]") in `num_processes` worker processes of
    `devices_per_process` CPU devices each; their results by mesh. Fails the test with the workers'
    output when one fails or they run past `timeout_s`; never leaves a worker behind."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [out / f"process{i}.log" for i in range(num_processes)]
    procs: list[subprocess.Popen] = []
    try:
        for i, log in enumerate(logs):
            command = [
                sys.executable, "-m", "tests.kda_impl.parallel_scenario",
                "--num-processes", str(num_processes),
                "--process-id", str(i),
                "--devices-per-process", str(devices_per_process),
                "--coordinator", coordinator,
                *(arg for mesh in meshes for arg in ("--mesh", mesh)),
                "--out", str(out),
            ]  # fmt: skip
            with log.open("w") as sink:
                procs.append(
                    subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + timeout_s
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            if any(proc.returncode not in (None, 0) for proc in procs):
                break
            time.sleep(0.2)
        codes = [proc.poll() for proc in procs]
        if codes != [0] * num_processes:
            state = f"ran past {timeout_s:g} s" if None in codes else f"exited with {codes}"
            pytest.fail(f"the worker processes {state}:\n{_tails(logs)}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for mesh in meshes:
        with np.load(_result_file(out, mesh)) as stored:
            results[mesh] = dict(stored)
    return results


def _tails(logs: list[Path], lines: int = 20) -> str:
    return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-lines:]) for log in logs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, required=True)
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="needed with more than one process")
    parser.add_argument("--mesh", action="append", required=True, metavar="TPxDP[:KERNEL]")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    prefer_fast_cpu_compile()  # as the test session does, before JAX starts

    if args.num_processes > 1:
        from kda_impl.parallel.distributed import initialize

        initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            cpu_devices_per_process=args.devices_per_process,
        )
    else:
        jax.config.update("jax_num_cpu_devices", args.devices_per_process)
    for mesh in args.mesh:
        tp, dp, kernel = parse_mesh(mesh)
        result = run_scenario(make_mesh(tp, dp), kernel)
        if args.process_id == 0:
            np.savez(_result_file(args.out, mesh), **result)


if __name__ == "__main__":
    main()
