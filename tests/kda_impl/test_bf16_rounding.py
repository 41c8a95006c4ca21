"""Every bf16 rounding point of `KimiDeltaAttention` sits where docs/bf16-rounding.md says it does.

One bf16 prefill of the mini layer, and each stage re-derived by hand in float64 numpy from the layer's own
bf16 weights, rounding to bf16 (round to nearest even) exactly where the table rounds and nowhere else.
A bf16 stage must equal its re-derivation bit for bit, an fp32 stage within fp32 accuracy, on (almost)
every element: float64 sums and XLA's fp32 sums may land on opposite sides of a bf16 rounding boundary
on a rare element, so 99.5% must match. Each test also derives the stage with the rounding moved (to
where transformers' port puts it, or dropped) and checks that this variant matches clearly fewer
elements, so a moved rounding fails the test rather than slipping through.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode, make_forward_batch, pad_rows
from kda_impl.models.kimi_linear import KimiDeltaAttention, jit_forward
from kda_impl.weights import layer_from_hf_weights
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.truth import delta_rule
from kda_spec.weight_names import PROJECTIONS

TOKENS = 64
MATCHING = 0.995  # share of elements that must match the table's derivation
MOVED_AT_MOST = 0.9  # share of elements where the moved rounding agrees: above it, no telling them apart
FP32_RTOL = 1e-5  # an fp32 stage against its float64 derivation


def bf16(x: np.ndarray) -> np.ndarray:
    """`x` rounded to the nearest bf16 (ties to even), as float64."""
    as_bf16 = jnp.asarray(np.asarray(x, np.float32), jnp.bfloat16)
    return np.asarray(as_bf16.astype(jnp.float32), np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def l2_normalised(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@dataclasses.dataclass
class Prefill:
    """The layer's bf16 prefill of one sequence from a zero state, and its weights, as float64 numpy."""

    hidden: np.ndarray  # [T, hidden] fp32 values, not bf16-representable
    results: dict[str, np.ndarray]  # the intermediates (`[T, H, D]` / `[T, H]`) and "out" [T, hidden]
    conv_state: np.ndarray  # [W-1, 3, P] the slot's conv state afterwards
    recurrent_state: np.ndarray  # [H, D, D] the slot's recurrent state afterwards
    params: dict[str, np.ndarray]  # the layer's parameters by name (kernels [in, out], taps [W, P])
    heads: int
    dim: int
    eps: float

    def projection(self, name: str, x: np.ndarray) -> np.ndarray:
        """`x @ kernel` in float64, not rounded."""
        return x @ self.params[name]

    def conv(self, u: np.ndarray, taps: str) -> np.ndarray:
        """The causal depthwise conv of `u` [T, P] from a zero state, in float64, not rounded."""
        weight = self.params[taps]
        width = weight.shape[0]
        padded = np.concatenate([np.zeros((width - 1, u.shape[1])), u])
        return sum(padded[j : j + len(u)] * weight[j] for j in range(width))

    def heads_of(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(len(x), self.heads, self.dim)


def _parameters(layer: KimiDeltaAttention) -> dict[str, np.ndarray]:
    def value(param: jax.Array) -> np.ndarray:
        return np.asarray(param[...].astype(jnp.float32), np.float64)

    params = {name: value(getattr(layer, name).kernel) for name in PROJECTIONS}
    params.update({name: value(getattr(layer, name)) for name in ("q_conv1d", "k_conv1d", "v_conv1d")})
    params.update(A_log=value(layer.A_log), dt_bias=value(layer.dt_bias), o_norm=value(layer.o_norm.weight))
    return params


@pytest.fixture(scope="module")
def prefill() -> Prefill:
    config = get_preset("mini")
    layer = layer_from_hf_weights(config, 0, synthetic_weights(config, seed=0), jnp.bfloat16)
    pool = RecurrentStatePool.create(config, 2, jnp.bfloat16, layer_ids=[0])
    slots = pool.alloc(1)
    batch = make_forward_batch(
        KDAAttnBackend(), ForwardMode.EXTEND, [TOKENS], slots, num_slots=pool.num_slots
    )
    hidden = np.random.default_rng(7).standard_normal((TOKENS, config.hidden_size)).astype(np.float32)
    step = jit_forward(layer, return_intermediates=True)
    out, pool, intermediates = step(jnp.asarray(pad_rows(hidden, batch.num_tokens)), batch, pool)

    def real(x: jax.Array) -> np.ndarray:
        return np.asarray(x[:TOKENS].astype(jnp.float32), np.float64)

    results = {name: real(value) for name, value in intermediates.items()} | {"out": real(out)}
    recurrent, conv = pool.get_linear_recurrent_layer_cache(0)
    slot = int(slots[0])
    return Prefill(
        hidden=hidden.astype(np.float64),
        results=results,
        conv_state=np.asarray(conv[slot].astype(jnp.float32), np.float64),
        recurrent_state=np.asarray(recurrent[slot], np.float64),
        params=_parameters(layer),
        heads=config.num_heads,
        dim=config.head_dim,
        eps=config.rms_norm_eps,
    )


def share_matching(actual: np.ndarray, derived: np.ndarray, rtol: float) -> float:
    """The share of elements equal to the derivation: bit for bit (`rtol` 0) or within `rtol`."""
    assert actual.shape == derived.shape, f"{actual.shape} vs derivation {derived.shape}"
    return float(np.mean(np.abs(actual - derived) <= rtol * np.abs(derived)))


def assert_rounded_as_table(
    stage: str, actual: np.ndarray, table: np.ndarray, moved: np.ndarray, rtol: float = 0.0
) -> None:
    """`actual` matches the table's rounding (`table`) and not the moved one (`moved`)."""
    matching, moved_matching = share_matching(actual, table, rtol), share_matching(actual, moved, rtol)
    assert share_matching(table, moved, rtol) <= MOVED_AT_MOST, f"{stage}: the variants do not differ here"
    assert matching >= MATCHING, (
        f"{stage}: {matching:.2%} of the elements match the table's rounding (moved rounding: "
        f"{moved_matching:.2%}); docs/bf16-rounding.md"
    )


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_short_conv_rounds_once_after_silu(prefill: Prefill, name: str):
    """The hub's (fla's) fused conv + silu: fp32 sum of the rounded projections, silu, one rounding."""
    projected = bf16(prefill.projection(f"{name}_proj", bf16(prefill.hidden)))
    summed = prefill.conv(projected, f"{name}_conv1d")
    conv_silu = bf16(summed * sigmoid(summed))
    transformers_port = bf16(bf16(summed) * sigmoid(bf16(summed)))  # conv rounded, then silu rounded
    actual = prefill.results[f"{name}_after_conv"].reshape(TOKENS, -1)
    assert_rounded_as_table(f"{name}_after_conv", actual, conv_silu, transformers_port)


def test_short_conv_inputs_are_the_rounded_projections(prefill: Prefill):
    """Projections rounded before the conv (and the hidden states before the projections)."""
    summed = prefill.conv(bf16(prefill.projection("q_proj", bf16(prefill.hidden))), "q_conv1d")
    unrounded = prefill.conv(prefill.projection("q_proj", prefill.hidden), "q_conv1d")
    actual = prefill.results["q_after_conv"].reshape(TOKENS, -1)
    assert_rounded_as_table(
        "q_proj", actual, bf16(summed * sigmoid(summed)), bf16(unrounded * sigmoid(unrounded))
    )


def test_conv_state_holds_the_rounded_projections(prefill: Prefill):
    """The new conv state is the last W-1 rounded projections of q | k | v, exactly."""
    x = bf16(prefill.hidden)
    history = prefill.conv_state.shape[0]
    for index, name in enumerate(("q", "k", "v")):
        projected = prefill.projection(f"{name}_proj", x)[-history:]
        assert_rounded_as_table(
            f"{name} conv state", prefill.conv_state[:, index], bf16(projected), projected
        )


def test_beta_is_the_fp32_sigmoid_of_the_rounded_projection(prefill: Prefill):
    """The hub's `b_proj(x).float().sigmoid()`; transformers rounds the sigmoid to bf16 as well."""
    projected = bf16(prefill.projection("b_proj", bf16(prefill.hidden)))
    assert_rounded_as_table(
        "beta", prefill.results["beta"], sigmoid(projected), bf16(sigmoid(projected)), rtol=FP32_RTOL
    )


def test_decay_gate_is_fp32_from_two_rounded_projections(prefill: Prefill):
    """f_a's and f_b's outputs rounded, the gate `-exp(A_log) * softplus(f + dt_bias)` in fp32."""
    x = bf16(prefill.hidden)

    def gate(f: np.ndarray) -> np.ndarray:
        raw = prefill.heads_of(f) + prefill.params["dt_bias"]
        return -np.exp(prefill.params["A_log"])[:, None] * softplus(raw)

    table = gate(bf16(prefill.projection("f_b_proj", bf16(prefill.projection("f_a_proj", x)))))
    moved = gate(bf16(prefill.projection("f_b_proj", prefill.projection("f_a_proj", x))))  # f_a kept wide
    assert_rounded_as_table("g", prefill.results["g"], table, moved, rtol=FP32_RTOL)


def test_output_gate_is_two_rounded_projections(prefill: Prefill):
    x = bf16(prefill.hidden)
    table = bf16(prefill.projection("g_b_proj", bf16(prefill.projection("g_a_proj", x))))
    moved = bf16(prefill.projection("g_b_proj", prefill.projection("g_a_proj", x)))  # g_a kept wide
    assert_rounded_as_table(
        "g_out", prefill.results["g_out"], prefill.heads_of(table), prefill.heads_of(moved)
    )


def _kernel_output(prefill: Prefill) -> tuple[np.ndarray, np.ndarray]:
    """o [T, H, D] and the final state of the float64 delta rule on the layer's own kernel inputs (q, k
    l2-normalised in float64 from the rounded conv outputs; g and beta as the layer computed them)."""
    results = prefill.results
    return delta_rule(
        l2_normalised(results["q_after_conv"]),
        l2_normalised(results["k_after_conv"]),
        results["v_after_conv"],
        results["g"],
        results["beta"],
        np.zeros((prefill.heads, prefill.dim, prefill.dim)),
    )


def test_output_norm_rounds_the_kernel_output_then_its_own(prefill: Prefill):
    """o rounded once, the gated RMSNorm in fp32 on it, its output rounded once."""
    o, _ = _kernel_output(prefill)
    gate = sigmoid(prefill.results["g_out"])

    def norm(x: np.ndarray) -> np.ndarray:
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + prefill.eps)
        return x / rms * prefill.params["o_norm"] * gate

    assert_rounded_as_table("o_norm", prefill.results["o_norm"], bf16(norm(bf16(o))), bf16(norm(o)))


def test_recurrent_state_stays_fp32(prefill: Prefill):
    _, state = _kernel_output(prefill)
    assert_rounded_as_table("recurrent state", prefill.recurrent_state, state, bf16(state), rtol=1e-4)


def test_o_proj_rounds_once(prefill: Prefill):
    """The fp32 sum over the heads' rows of o_proj, rounded once (also across tensor ranks)."""
    o_norm = prefill.results["o_norm"].reshape(TOKENS, -1)
    summed = prefill.projection("o_proj", o_norm)
    half = o_norm.shape[1] // 2  # two rounded halves: a per-rank rounding before the psum
    per_rank = bf16(o_norm[:, :half] @ prefill.params["o_proj"][:half]) + bf16(
        o_norm[:, half:] @ prefill.params["o_proj"][half:]
    )
    assert_rounded_as_table("out", prefill.results["out"], bf16(summed), bf16(per_rank))
