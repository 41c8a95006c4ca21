"""The built-in adapter's shape buckets: coarse enough that a run compiles little, invisible in results."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conformance.adapters.kda_impl_adapter import KDAImplAdapter, token_bucket
from conformance.checks.calls import l2norm
from conformance.dumps.reader import DumpSet
from kda_impl.kernels import chunk_kda

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


@pytest.mark.parametrize(("tokens", "padded"), [(1, 64), (64, 64), (65, 1024), (1024, 1024), (1025, 16384)])
def test_token_buckets_are_a_power_of_sixteen_apart(tokens: int, padded: int) -> None:
    assert token_bucket(tokens) == padded


@pytest.mark.parametrize("case_id", ["T65", "varlen_initstate"])
def test_the_padded_kernel_call_gives_the_unpadded_kernel_result(case_id: str) -> None:
    """T65 runs padded to 1024 tokens and 8 sequences, with zeros for its missing initial state; the
    kernel called directly on the unpadded case gives the same output and states."""
    dumps = DumpSet(str(GOLDEN))
    case = dumps.case(case_id)
    adapter = KDAImplAdapter(dumps.config, dict(dumps.weights()), "fp32", "naive")
    q, k, v, g, beta = (
        case.result(name, "fp32") for name in ("q_after_conv", "k_after_conv", "v_after_conv", "g", "beta")
    )
    q, k = l2norm(q), l2norm(k)
    o, state = adapter.chunk_kernel(q, k, v, g, beta, case.cu_seqlens, case.initial_state)
    init = None if case.initial_state is None else jnp.asarray(case.initial_state)
    direct_o, direct_state = chunk_kda(
        *(jnp.asarray(x)[None] for x in (q, k, v, g, beta)),
        initial_state=init,
        output_final_state=True,
        cu_seqlens=jnp.asarray(case.cu_seqlens),
        kernel="naive",
    )
    np.testing.assert_allclose(o, np.asarray(direct_o)[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state, np.asarray(direct_state), rtol=1e-6, atol=1e-7)
