"""The sglang-jax adapter's raw-gate kernels (issue 42): `chunk_kda_fwd` with the gate in the kernel, as
its `KDAAttnBackend` calls it, and its decode path (`_fused_kda_gate`, then the naive recurrence).

The runs need a sglang-jax checkout (`$SGLANG_JAX`); without one they skip with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from conformance.adapter import RawGateKernelAdapter, protocol_error, provided_calls, unserved_family
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSpec
from conformance.checks.kinds import Check
from conformance.checks.runner import RAW_GATE_KERNEL_TRUTH_SOURCE, CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.search.dumpcase import CASE_ID, write_case_set
from conformance.search.space import SearchCase
from conformance.search.weight_sets import weight_sets
from examples.sglang_jax.adapter import SglangJaxAdapter
from kda_spec.config import get_preset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
needs_checkout = pytest.mark.skipif(
    not os.environ.get("SGLANG_JAX"), reason="no sglang-jax checkout: set SGLANG_JAX=/path/to/sglang-jax"
)


def test_the_adapter_declares_the_raw_gate_protocol_for_kimi_linear_only() -> None:
    assert issubclass(SglangJaxAdapter, RawGateKernelAdapter)
    assert protocol_error(SglangJaxAdapter) is None
    assert {"chunk_kernel_raw_gate", "recurrent_kernel_raw_gate"} <= provided_calls(SglangJaxAdapter)
    assert frozenset({"kimi-linear"}) == SglangJaxAdapter.FAMILIES
    glm = get_preset("glm5-next-mini")
    assert unserved_family(SglangJaxAdapter, glm) is not None  # every check of a GLM set skips


@pytest.fixture(scope="module")
def kimi_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Kimi-Linear case (40 + 20 tokens, small initial states) with g_raw, fp32."""
    weight_set = weight_sets(None, "mini", 0, {"kimi-linear"})["synthetic"]
    folder = tmp_path_factory.mktemp("sglang-raw-gate") / "set"
    case = SearchCase("fp32", "synthetic", (40, 20), init="small")
    write_case_set(str(folder), case, weight_set.weights, weight_set.config, weight_set.source, {})
    return folder


@needs_checkout
def test_sglang_jax_passes_the_raw_gate_checks(kimi_set: Path) -> None:
    runner = CheckRunner(
        DumpSet(str(kimi_set)),
        SglangJaxAdapter,
        "auto",
        TolerancePolicy.load(),
        {"sglang_jax": os.environ["SGLANG_JAX"]},
    )
    for kind in kinds.RAW_GATE_KERNEL_KINDS:
        comparison = runner.run(CheckSpec(CASE_ID, "fp32", Check(kind))).comparison
        assert comparison.passed, (kind, comparison.verdict)
        assert comparison.attribution.source == RAW_GATE_KERNEL_TRUTH_SOURCE


@needs_checkout
def test_its_decode_gate_has_no_lower_bound() -> None:
    """sglang-jax's `_fused_kda_gate` is the softplus gate: a lower bound is a path it lacks (the check
    skips with this reason), raised before anything runs."""
    config = get_preset("mini")
    adapter = SglangJaxAdapter(
        config,
        weight_sets(None, "mini", 0, {"kimi-linear"})["synthetic"].weights,
        "fp32",
        options=SglangJaxAdapter.parse_options({"sglang_jax": os.environ["SGLANG_JAX"]}),
    )
    heads, dim = config.num_heads, config.head_dim
    x = np.zeros((4, heads, dim), np.float32)
    with pytest.raises(NotImplementedError, match=r"_fused_kda_gate\) is the softplus gate only"):
        adapter.recurrent_kernel_raw_gate(
            x, x, x, x, np.zeros((4, heads), np.float32), np.zeros(heads, np.float32),
            np.zeros(heads * dim, np.float32), -3.0, np.array([0, 4]), None,
        )  # fmt: skip
