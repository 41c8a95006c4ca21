"""docs/parallelism.md's example runs as written, on four CPU devices, and matches the unsharded layer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "parallelism.md"

# Run after the example, in its namespace: the same requests on one device must give the same rows.
CHECK = """
import jax
from kda_impl.model_executor.forward_batch import make_forward_batch

assert len(jax.devices()) == 4 and out.shape == (batch.num_tokens, config.hidden_size)
single = layer_from_hf_weights(config, 0, weights, jnp.bfloat16)
single_pool = RecurrentStatePool.create(config, 8, jnp.bfloat16, layer_ids=[0])
for rank, lens in enumerate(seq_lens):
    own = make_forward_batch(
        KDAAttnBackend(), ForwardMode.EXTEND, seq_lens=lens,
        recurrent_indices=single_pool.alloc(len(lens)), num_slots=single_pool.num_slots,
    )
    x = np.zeros((own.num_tokens, config.hidden_size), np.float32)
    for own_rows, rows in zip(own.request_rows(0, lens), batch.request_rows(rank, lens)):
        x[own_rows] = hidden[rows]
    ref, single_pool = jit_forward(single)(x, own, single_pool)
    for own_rows, rows in zip(own.request_rows(0, lens), batch.request_rows(rank, lens)):
        np.testing.assert_allclose(
            np.asarray(out[rows], np.float32), np.asarray(ref[own_rows], np.float32), atol=2e-2, rtol=2e-2
        )
print("example ok")
"""


def test_parallelism_example_runs_on_four_devices(tmp_path: Path) -> None:
    text = DOC.read_text()
    section = text[text.index("## Using it") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code + textwrap.dedent(CHECK))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "example ok" in result.stdout
