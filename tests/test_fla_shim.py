"""The fla shim (tests/fla_shim) without an fla checkout: its adapters against fla-core's installed torch
references, and its plugin on a small test file of our own written as fla's tests/ops/test_kda.py is (the
same imports and calls), in a stand-in checkout. The run on fla's own tests needs a checkout:
`make fla-tests FLA=PATH` (docs/kernels.md)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.torch

# A test module in fla's form: its imports, `device`, fla's references and assert_close; a forward test
# with a gradient check, an option kda_impl does not have, a failing check, and a GPU-only skip.
FAKE_TEST_KDA = """
import pytest
import torch
import torch.nn.functional as F

from fla.ops.kda import chunk_kda, fused_recurrent_kda
from fla.ops.kda.naive import naive_recurrent_kda
from fla.utils import assert_close, device


def inputs(HV):
    torch.manual_seed(0)
    q, k = (torch.rand(1, 20, 1, 16, device=device).requires_grad_() for _ in range(2))
    v = torch.rand(1, 20, HV, 16, device=device)
    g = F.logsigmoid(torch.randn(1, 20, HV, 16, device=device))
    return q, k, v, g, torch.rand(1, 20, HV, device=device)


@pytest.mark.parametrize("HV", [1, 2])
def test_forward_and_backward(HV):
    q, k, v, g, beta = inputs(HV)
    ref, ref_ht = naive_recurrent_kda(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta,
                                      output_final_state=True)
    tri, tri_ht = fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    tri.sum().backward()
    assert_close("o", ref, tri, 0.005)
    assert_close("ht", ref_ht, tri_ht, 0.005)
    assert_close("dq", ref, q.grad, 0.005)


def test_unsupported():
    chunk_kda(*inputs(1), use_graph=True)


def test_failing_check():
    tri, _ = fused_recurrent_kda(*inputs(1))
    assert_close("o", 2 * tri, tri, 0.005)


@pytest.mark.skipif(True, reason="test_x requires CUDA or NPU")
def test_gpu_only():
    assert torch.device("cuda").type == "cpu"
"""


def test_plugin_counts_a_fla_style_test_file(tmp_path: Path):
    """Forward checks run, gradient checks do not (counted), an fla-only option is unsupported, a wrong
    result fails, a GPU-only skip of fla's own kernels is lifted; the JSON report says so."""
    from tests.fla_shim import adapters
    from tests.fla_shim.__main__ import main

    ops = tmp_path / "tests" / "ops"
    ops.mkdir(parents=True)
    (ops / "test_kda.py").write_text(textwrap.dedent(FAKE_TEST_KDA))
    report = tmp_path / "report.json"
    try:
        status = main(["--fla", str(tmp_path), "--report", str(report)])
    finally:
        adapters.KERNEL = "naive"
    summary = json.loads(report.read_text())
    assert status == 1  # a test failed
    counts = {key: summary[key] for key in ("run", "passed", "failed", "unsupported", "skipped")}
    assert counts == {"run": 5, "passed": 3, "failed": 1, "unsupported": 1, "skipped": 0}
    tests = summary["tests"]
    assert tests["test_forward_and_backward[2]"]["backward_checks_not_run"] == ["dq"]
    assert "use_graph" in tests["test_unsupported"]["reason"]
    assert tests["test_failing_check"]["outcome"] == "failed"
    assert summary["tests_with_backward_checks_not_run"] == 2


def test_decode_adapter_updates_the_pool_in_place_as_fla():
    """fla's vLLM form of fused_recurrent_kda_fwd (one token per sequence, the pool at
    ssm_state_indices updated in place) by kda_impl's decode, against fla's naive recurrence per slot."""
    import torch
    import torch.nn.functional as F
    from fla.ops.kda.naive import naive_recurrent_kda

    from tests.fla_shim import adapters

    torch.manual_seed(1)
    batch, heads, dim = 3, 2, 16
    pool = torch.randn(6, heads, dim, dim)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    q, k, v = (torch.rand(1, batch, heads, dim) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, batch, heads, dim))
    beta = torch.rand(1, batch, heads)
    o, returned = adapters.fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, inplace_final_state=True,
        cu_seqlens=torch.arange(batch + 1), ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert returned is pool
    for row, slot in enumerate(slots.tolist()):
        ref_o, ref_state = naive_recurrent_kda(
            F.normalize(q[:, row : row + 1], dim=-1), F.normalize(k[:, row : row + 1], dim=-1),
            v[:, row : row + 1], g[:, row : row + 1], beta[:, row : row + 1],
            initial_state=before[slot : slot + 1], output_final_state=True,
        )  # fmt: skip
        np.testing.assert_allclose(o[0, row].numpy(), ref_o[0, 0].numpy(), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(pool[slot].numpy(), ref_state[0].numpy(), atol=1e-5, rtol=1e-5)
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])
