"""One mesh across two processes (`jax.distributed`, CPU collectives over loopback through gloo): TP = 8,
whose one collective crosses the processes, and TP = 4 x DP = 2, a data rank per process, over 2 x 4 CPU
devices give the single-process, unsharded result.
"""

from __future__ import annotations

from tests.kda_impl.parallel_scenario import assert_matches_single_device, launch

MESHES = ("8x1", "4x2")
TIMEOUT_S = 120


def test_two_processes_give_the_single_process_result(tmp_path):
    results = launch(tmp_path, MESHES, num_processes=2, devices_per_process=4, timeout_s=TIMEOUT_S)
    for mesh in MESHES:
        assert_matches_single_device(results[mesh])
