"""kda_impl's fp32 paths run every matmul at full fp32 precision, proven from their jaxprs on any machine.

At DEFAULT precision an fp32 dot is one bf16 pass on a TPU and TF32 on an A100/H100, so a forgotten
`precision=` passes on a CPU and fails a TPU's fp32 checks by orders of magnitude. These tests trace
(never run) the layer's prefill (EXTEND: the chunk kernel) and decode (DECODE: the decode kernel), and
the two kernel entry points the adapter calls (`chunk_kda`, `fused_recurrent_kda`), each with the plain
JAX kernels and the Pallas ones (interpret mode on a CPU: the kernel body is the pallas_call's jaxpr),
and list every floating-point `dot_general` not at `Precision.HIGHEST` (`tests/kda_impl/jaxpr_dots.py`).

Shapes: the `mini` layer (hidden 128, H = 2 heads of D = 64, conv width 4); the prefill packs two
sequences of 3 and 127 tokens (a partial chunk and one past the 64-token chunk) from initial states,
padded to a bucket of 256 tokens; the decode steps two requests one token each. The kernels get
q, k, v, g `[1, 130, 2, 64]`, beta `[1, 130, 2]`, the same two sequences by `cu_seqlens`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.kernels import chunk_kda, fused_recurrent_kda
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode, make_forward_batch, pad_rows
from kda_impl.models.kimi_linear import jit_forward
from kda_impl.weights import layer_from_hf_weights
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights
from tests.kda_impl.jaxpr_dots import dots, reduced_precision_dots
from tests.kda_impl.kernel_inputs import random_kernel_inputs

CONFIG = get_preset("mini")
SEQ_LENS = (3, 127)
TOKEN_BUCKET = 256
KERNELS = ("naive", "pallas")


def assert_full_fp32(traced: jax.extend.core.ClosedJaxpr) -> None:
    """Every floating-point dot of `traced` at full fp32 precision."""
    reduced = reduced_precision_dots(traced)
    assert not reduced, f"{len(reduced)} fp32 dot(s) below HIGHEST, e.g. " + "; ".join(map(str, reduced[:3]))


def layer_trace(kernel: str, mode: ForwardMode) -> jax.extend.core.ClosedJaxpr:
    """The jaxpr of one fp32 serving step of the layer with `kernel`'s kernels (traced, not run)."""
    module = layer_from_hf_weights(CONFIG, 0, synthetic_weights(CONFIG, seed=0), jnp.float32)
    pool = RecurrentStatePool.create(CONFIG, 4, jnp.float32, layer_ids=(0,))
    slots = pool.alloc(len(SEQ_LENS))
    seq_lens = SEQ_LENS if mode == ForwardMode.EXTEND else (1,) * len(SEQ_LENS)
    batch = make_forward_batch(
        KDAAttnBackend(kernel=kernel),
        mode,
        seq_lens,
        pool.get_recurrent_indices(slots),
        num_slots=pool.num_slots,
        min_tokens=TOKEN_BUCKET,
    )
    hidden = np.random.default_rng(0).standard_normal((sum(seq_lens), CONFIG.hidden_size), np.float32)
    step = jit_forward(module, return_intermediates=True)
    return jax.make_jaxpr(step)(jnp.asarray(pad_rows(hidden, batch.num_tokens)), batch, pool)


def kernel_trace(entry: Callable, kernel: str) -> jax.extend.core.ClosedJaxpr:
    """The jaxpr of one fp32 kernel call of the packed sequences from initial states (traced, not run)."""
    inputs = random_kernel_inputs(np.random.default_rng(0), sum(SEQ_LENS), heads=2, dim=64)
    cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(SEQ_LENS)]), jnp.int32)
    states = jnp.zeros((len(SEQ_LENS), 2, 64, 64), jnp.float32)
    call = functools.partial(
        entry,
        initial_state=states,
        cu_seqlens=cu_seqlens,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        kernel=kernel,
    )
    return jax.make_jaxpr(call)(**{name: jnp.asarray(value) for name, value in inputs.items()})


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["prefill", "decode"])
def test_layer_fp32_step_has_only_full_precision_dots(kernel: str, mode: ForwardMode) -> None:
    traced = layer_trace(kernel, mode)
    assert list(dots(traced)), "the step has no dot_general at all (its projections are matmuls)"
    assert_full_fp32(traced)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("entry", [chunk_kda, fused_recurrent_kda], ids=["chunk", "fused_recurrent"])
def test_kernel_fp32_call_has_only_full_precision_dots(entry: Callable, kernel: str) -> None:
    traced = kernel_trace(entry, kernel)
    # The Pallas token recurrence has no matmul at all: its products are lane broadcasts and sublane
    # sums (kda_impl/kernels/pallas/common.py, `column_step`); every other kernel has dots to check.
    has_no_matmul = entry is fused_recurrent_kda and kernel == "pallas"
    assert bool(list(dots(traced))) != has_no_matmul
    assert_full_fp32(traced)


def test_pallas_traces_reach_the_kernel_body() -> None:
    """The Pallas prefill's dots are found inside the pallas_call's kernel jaxpr, not only around it."""
    paths = [dot.path for dot in dots(layer_trace("pallas", ForwardMode.EXTEND))]
    assert any(any(part.startswith("pallas_call.") for part in path) for path in paths), paths


# --- the walker itself can fail ----------------------------------------------------------------------


def _operands() -> tuple[jax.Array, jax.Array]:
    return jnp.ones((4, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: lambda a, b: a @ b, id="matmul"),
        pytest.param(lambda: lambda a, b: jnp.einsum("ij,jk->ik", a, b), id="einsum"),
        pytest.param(lambda: jax.jit(lambda a, b: jnp.dot(a, b)), id="inside-pjit"),
        pytest.param(
            lambda: lambda a, b: jax.lax.scan(lambda c, _: (c + (a @ b).sum(), None), 0.0, None, length=2)[0],
            id="inside-scan",
        ),
        pytest.param(
            lambda: lambda a, b: jax.lax.cond(a[0, 0] > 0, lambda: a @ b, lambda: jnp.zeros((4, 4))),
            id="inside-cond",
        ),
        pytest.param(
            lambda: lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGH), id="precision-high"
        ),
        pytest.param(
            lambda: lambda a, b: jnp.dot(a, b, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32),
            id="bf16-algorithm",
        ),
    ],
)
def test_walker_flags_a_reduced_precision_dot(make: Callable) -> None:
    with pytest.raises(AssertionError, match="below HIGHEST"):
        assert_full_fp32(jax.make_jaxpr(make())(*_operands()))


@pytest.mark.parametrize(
    "precision",
    [jax.lax.Precision.HIGHEST, jax.lax.DotAlgorithmPreset.F32_F32_F32],
    ids=["highest", "f32-algorithm"],
)
def test_walker_accepts_full_precision_dots(precision: object) -> None:
    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        inner = jax.jit(lambda x: jnp.dot(x, b, precision=precision))
        return jax.lax.scan(lambda c, _: (c + inner(a).sum(), None), 0.0, None, length=2)[0]

    traced = jax.make_jaxpr(f)(*_operands())
    (path,) = [dot.path for dot in dots(traced)]  # found inside the jit inside the scan
    assert path[0] == "scan.jaxpr" and path[1].endswith("jit.jaxpr"), path
    assert_full_fp32(traced)


def test_walker_ignores_integer_dots() -> None:
    traced = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2), jnp.int32))
    assert list(dots(traced)) and not reduced_precision_dots(traced)
