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

# A test module in fla's form: its imports, `device`, fla's references and assert_close; a forward and
# backward test whose gradient checks hold kda_impl's dq and dk to fla's naive recurrence under torch
# autograd, an option kda_impl does not have, a failing forward check, failing gradient checks (one
# warning-only, as fla's dA) around a passing one, and a GPU-only skip.
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
    do = torch.randn(1, 20, HV, 16, device=device)
    ref, ref_ht = naive_recurrent_kda(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta,
                                      output_final_state=True)
    (ref * do).sum().backward()
    ref_dq, ref_dk, q.grad, k.grad = q.grad, k.grad, None, None
    tri, tri_ht = fused_recurrent_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (tri * do).sum().backward()
    assert_close("o", ref, tri, 0.005)
    assert_close("ht", ref_ht, tri_ht, 0.005)
    assert_close("dq", ref_dq, q.grad, 0.005)
    assert_close("dk", ref_dk, k.grad, 0.005)


def test_unsupported():
    chunk_kda(*inputs(1), use_graph=True)


def test_failing_check():
    tri, _ = fused_recurrent_kda(*inputs(1))
    assert_close("o", 2 * tri, tri, 0.005)


def test_failing_gradient_check():
    q, k, v, g, beta = inputs(1)
    tri, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    tri.sum().backward()
    assert_close("dq", 2 * q.grad, q.grad, 0.005)
    assert_close("dk", k.grad, k.grad, 0.005)
    assert_close("dA", 2 * k.grad, k.grad, 0.003, warning=True)


@pytest.mark.skipif(True, reason="test_x requires CUDA or NPU")
def test_gpu_only():
    assert torch.device("cuda").type == "cpu"
"""


def test_plugin_counts_a_fla_style_test_file(tmp_path: Path):
    """Forward and backward checks run and are counted apart, per test and in all: kda_impl's gradients
    pass against fla's naive recurrence; a failed check fails its test after the test's later checks
    ran, a warning-only one (fla's dA) is counted failed without failing its test; an fla-only option is
    unsupported, a GPU-only skip of fla's own kernels is lifted; the JSON report says so."""
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
    assert counts == {"run": 6, "passed": 3, "failed": 2, "unsupported": 1, "skipped": 0}
    assert summary["forward_checks"] == {"passed": 4, "failed": 1, "failed_warning_only": 0}
    assert summary["backward_checks"] == {"passed": 5, "failed": 2, "failed_warning_only": 1}
    tests = summary["tests"]
    for hv in (1, 2):
        both = tests[f"test_forward_and_backward[{hv}]"]
        assert both["outcome"] == "passed"
        assert (
            both["forward_checks"]
            == both["backward_checks"]
            == {"passed": 2, "failed": 0, "failed_warning_only": 0}
        )
    gradient = tests["test_failing_gradient_check"]
    assert gradient["outcome"] == "failed"
    assert gradient["backward_checks"] == {"passed": 1, "failed": 2, "failed_warning_only": 1}
    assert [failure.split()[0] for failure in gradient["failed_checks"]] == ["dq", "dA"]
    assert gradient["failed_checks"][1].endswith("(warning only)")
    assert tests["test_failing_check"]["forward_checks"]["failed"] == 1
    assert "use_graph" in tests["test_unsupported"]["reason"]


def test_adapter_gradients_under_both_kernels():
    """The chunk adapter's gradients of every float input (float64 tensors, computed in float32), in the
    inputs' dtype, against torch autograd of fla's naive recurrence (float32 arithmetic whatever its
    inputs' dtype); under `KERNEL = "pallas"` the same gradients to the bit (the backward is the
    plain-JAX kernel's)."""
    import torch
    import torch.nn.functional as F
    from fla.ops.kda.naive import naive_recurrent_kda

    from tests.fla_shim import adapters

    torch.manual_seed(2)
    q, k, v = (torch.rand(2, 40, 2, 16, dtype=torch.float64) for _ in range(3))
    g = F.logsigmoid(torch.randn(2, 40, 2, 16, dtype=torch.float64))
    beta, h0 = torch.rand(2, 40, 2, dtype=torch.float64), torch.randn(2, 2, 16, 16, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    do, dht = torch.randn(2, 40, 2, 16, dtype=torch.float64), torch.randn(2, 2, 16, 16, dtype=torch.float64)

    def gradients(function, **options):
        o, ht = function(*inputs[:5], initial_state=h0, output_final_state=True, **options)
        return torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)

    reference = gradients(
        lambda q, k, *rest, **kw: naive_recurrent_kda(
            F.normalize(q, dim=-1), F.normalize(k, dim=-1), *rest, **kw
        )
    )
    by_kernel = {}
    try:
        for kernel in ("naive", "pallas"):
            adapters.KERNEL = kernel
            by_kernel[kernel] = gradients(adapters.chunk_kda, use_qk_l2norm_in_kernel=True)
    finally:
        adapters.KERNEL = "naive"
    for expected, plain, pallas in zip(reference, by_kernel["naive"], by_kernel["pallas"], strict=True):
        assert plain.dtype == torch.float64 and plain.shape == expected.shape
        assert (plain - expected).norm() <= 1e-5 * expected.norm()
        assert torch.equal(plain, pallas)


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
