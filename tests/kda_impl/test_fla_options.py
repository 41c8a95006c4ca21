"""fla 0.6.0's forward options (`kda_impl.kernels.options`) on every entry point, plain JAX and Pallas
(interpret mode), against the float64 token recurrence (`kda_spec.truth`) with the options applied as fla
defines them: the in-kernel gate (Kimi's softplus form and the lower-bound form, A_log as [HV], fla's
[1, 1, HV, 1] or None), beta as logits (with allow_neg_eigval: 2 sigmoid(beta)), GVA (value head j reads
q/k head j // (HV / H)), v-first states, the intermediate states of the chunk kernels, and fla's argument
checks. One small packed batch (D = 128, the Pallas kernels' tile) serves every test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.kernels import naive, pallas
from kda_spec.truth import packed_delta_rule
from tests.kda_impl.kernel_inputs import l2normalise

FP32 = {"atol": 2e-5, "rtol": 2e-5}
HEADS, VALUE_HEADS, DIM = 1, 2, 128  # GVA: two value heads per q/k head
LENGTHS = [5, 0, 40]  # a short sequence, an empty one, one over a chunk
KERNELS = {"naive": naive, "pallas": pallas}
# (use_gate_in_kernel's form, A_log's shape or None, allow_neg_eigval, state_v_first)
OPTIONS = {
    "kimi-gate": ("softplus", (VALUE_HEADS,), False, False),
    "lower-bound-gate-v-first": ("lower-bound", (1, 1, VALUE_HEADS, 1), True, True),
    "lower-bound-no-A_log": ("lower-bound", None, False, False),
}
LOWER_BOUND = -5.0


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def raw_inputs(rng: np.random.Generator, tokens: int, batch: int = 1) -> dict[str, np.ndarray]:
    """q, k [B, T, H, D]; v, the raw gate g [B, T, HV, D]; beta logits [B, T, HV]; fp32."""
    qk_shape, value_shape = (batch, tokens, HEADS, DIM), (batch, tokens, VALUE_HEADS, DIM)
    return {
        "q": rng.standard_normal(qk_shape).astype(np.float32),
        "k": rng.standard_normal(qk_shape).astype(np.float32),
        "v": rng.standard_normal(value_shape).astype(np.float32),
        "g": (rng.standard_normal(value_shape) * 3).astype(np.float32),
        "beta": (rng.standard_normal(value_shape[:3]) * 2).astype(np.float32),
    }


def gate_parameters(rng: np.random.Generator, a_log_shape: tuple[int, ...] | None) -> dict:
    a_log = None if a_log_shape is None else np.log(rng.uniform(1.0, 16.0, a_log_shape)).astype(np.float32)
    return {"A_log": a_log, "dt_bias": rng.standard_normal(VALUE_HEADS * DIM).astype(np.float32)}


def float64_truth(inputs: dict, gate: dict, form: str, allow_neg: bool, cu_seqlens, h0):
    """The options as fla defines them, in float64, then the token recurrence; (o [T, HV, V], finals
    [N, HV, K, V]) of the packed batch (B = 1)."""
    wide = {name: x[0].astype(np.float64) for name, x in inputs.items()}
    raw = wide["g"] + gate["dt_bias"].astype(np.float64).reshape(VALUE_HEADS, DIM)
    a = 1.0 if gate["A_log"] is None else np.exp(gate["A_log"].astype(np.float64).reshape(VALUE_HEADS, 1))
    g = -a * softplus(raw) if form == "softplus" else LOWER_BOUND * sigmoid(a * raw)
    beta = sigmoid(wide["beta"]) * (2.0 if allow_neg else 1.0)
    group = VALUE_HEADS // HEADS
    q, k = (np.repeat(l2normalise(wide[name]), group, axis=1) for name in ("q", "k"))
    return packed_delta_rule(q, k, wide["v"], g, beta, cu_seqlens, h0.astype(np.float64))


def run_with_options(run, rng, options: str, lengths: list[int], batch: int = 1, **kwargs):
    """`run` (a prefill entry point) with the options `OPTIONS[options]` on random raw inputs of
    `lengths` (B = 1 packed, or B rows of equal length) with initial states, and the float64 truth:
    (result, (truth's o [T, HV, V], truth's finals [N, HV, K, V]), truth of a prefix: (seq, tokens) ->
    the state after the first `tokens` of sequence `seq` [HV, K, V])."""
    form, a_log_shape, allow_neg, v_first = OPTIONS[options]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = raw_inputs(rng, int(offsets[-1]) // batch, batch=batch)
    gate = gate_parameters(rng, a_log_shape)
    h0 = rng.standard_normal((len(lengths), VALUE_HEADS, DIM, DIM)).astype(np.float32)
    result = run(
        **inputs,
        **gate,
        initial_state=np.swapaxes(h0, -1, -2) if v_first else h0,
        cu_seqlens=offsets if batch == 1 else None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        safe_gate=form == "lower-bound",
        lower_bound=LOWER_BOUND if form == "lower-bound" else None,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=allow_neg,
        state_v_first=v_first,
        **kwargs,
    )
    flat = {name: x.reshape(1, -1, *x.shape[2:]) for name, x in inputs.items()}

    def prefix_state(seq: int, tokens: int) -> np.ndarray:
        prefix = {name: x[:, offsets[seq] : offsets[seq] + tokens] for name, x in flat.items()}
        return float64_truth(prefix, gate, form, allow_neg, np.array([0, tokens]), h0[seq : seq + 1])[1][0]

    return result, float64_truth(flat, gate, form, allow_neg, offsets, h0), prefix_state


def as_k_first(state: jax.Array, options: str) -> np.ndarray:
    return np.swapaxes(np.asarray(state), -1, -2) if OPTIONS[options][3] else np.asarray(state)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_recurrent_options_match_the_float64_recurrence(rng, kernel, options):
    """GVA, the in-kernel gate, beta's sigmoid and the state layout together, on a packed batch with
    initial states (an empty sequence included), against the float64 recurrence."""
    (o, final), (ref_o, ref_final), _ = run_with_options(
        KERNELS[kernel].fused_recurrent_kda, rng, options, LENGTHS
    )
    assert o.shape == (1, sum(LENGTHS), VALUE_HEADS, DIM) and final.shape == ref_final.shape
    np.testing.assert_allclose(np.asarray(o)[0], ref_o, **FP32)
    np.testing.assert_allclose(as_k_first(final, options), ref_final, **FP32)


@pytest.mark.parametrize(
    ("kernel", "options", "batch"),
    [
        ("naive", "lower-bound-gate-v-first", 1),
        ("pallas", "lower-bound-gate-v-first", 1),
        ("naive", "kimi-gate", 2),
    ],
    ids=["naive-packed", "pallas-packed", "naive-rows"],
)
def test_chunk_options_and_intermediate_states(rng, kernel, options, batch):
    """The chunk kernels with the options as above, and `return_intermediate_states`: h
    `[B, NT, HV, K, V]` (its layout as the states'), h[b, i] the state after the first i * C tokens of
    its sequence; with cu_seqlens B = 1 and NT the chunks of all sequences in order. (B rows: h is cut
    from the kernels' chunk states by the shared `entry.chunk_states`, tested once.)"""
    chunk, lengths = 32, ([33, 0, 64, 7] if batch == 1 else [40, 40])
    (o, final, h), (ref_o, ref_final), prefix_state = run_with_options(
        KERNELS[kernel].chunk_kda, rng, options, lengths, batch, chunk_size=chunk,
        return_intermediate_states=True,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(o).reshape(ref_o.shape), ref_o, **FP32)
    np.testing.assert_allclose(as_k_first(final, options), ref_final, **FP32)
    starts = [(s, first) for s, length in enumerate(lengths) for first in range(0, length, chunk)]
    assert h.shape == (batch, len(starts) // batch, VALUE_HEADS, DIM, DIM)
    entering = [prefix_state(seq, first) for seq, first in starts]
    flat_h = as_k_first(h, options).reshape(len(starts), VALUE_HEADS, DIM, DIM)
    np.testing.assert_allclose(flat_h, np.stack(entering), **FP32)


@pytest.mark.parametrize("v_first", [False, True], ids=["k-first", "v-first"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_decode_options_match_the_float64_recurrence(rng, kernel, v_first):
    """Decode with GVA, the lower-bound gate, beta logits and either pool layout: each request's slot
    steps as the float64 recurrence does; the other slots are untouched."""
    inputs = raw_inputs(rng, 1, batch=3)
    step = {name: x[:, 0] for name, x in inputs.items()}
    gate = gate_parameters(rng, (VALUE_HEADS,))
    pool = rng.standard_normal((5, VALUE_HEADS, DIM, DIM)).astype(np.float32)  # [S, HV, K, V]
    slots = np.array([3, 1, 4], np.int32)
    o, new_pool = KERNELS[kernel].decode_kda_slots(
        **step,
        **gate,
        state_buffer=jnp.asarray(np.swapaxes(pool, -1, -2) if v_first else pool),
        slot_indices=slots,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=LOWER_BOUND,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
        state_v_first=v_first,
    )
    new_pool = np.swapaxes(np.asarray(new_pool), -1, -2) if v_first else np.asarray(new_pool)
    packed = {name: np.swapaxes(x, 0, 1) for name, x in inputs.items()}  # the 3 steps as one row of 3
    cu_seqlens = np.arange(4, dtype=np.int32)
    ref_o, ref_states = float64_truth(packed, gate, "lower-bound", True, cu_seqlens, pool[slots])
    np.testing.assert_allclose(np.asarray(o), ref_o, **FP32)
    np.testing.assert_allclose(new_pool[slots], ref_states, **FP32)
    np.testing.assert_array_equal(new_pool[[0, 2]], pool[[0, 2]])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fla_argument_checks(rng, kernel):
    """fla's checks, with its messages where its tests match them."""
    inputs = raw_inputs(rng, 8)
    chunk_kda = KERNELS[kernel].chunk_kda
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64 for KDA, got 16\."):
        chunk_kda(**inputs, chunk_size=16)
    with pytest.raises(
        ValueError, match=r"`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`"
    ):
        chunk_kda(**inputs, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="`lower_bound` must be specified when `safe_gate=True`"):
        chunk_kda(**inputs, use_gate_in_kernel=True, safe_gate=True, A_log=np.zeros(VALUE_HEADS))
    with pytest.raises(ValueError, match=r"`lower_bound` must be in the safe range \[-5, 0\), got -6.0"):
        chunk_kda(**inputs, use_gate_in_kernel=True, safe_gate=True, lower_bound=-6)
    with pytest.raises(ValueError, match=r"needs A_log of shape \[HV\]=\(2,\) unless lower_bound is set"):
        chunk_kda(**inputs, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"v has HV=3 heads, which must be a multiple of q's H=2"):
        two_heads = {name: np.concatenate([x, x], axis=2) for name, x in inputs.items() if name in ("q", "k")}
        chunk_kda(**{**inputs, **two_heads, "v": np.zeros((1, 8, 3, DIM), np.float32)})
    with pytest.raises(ValueError, match=r"initial_state.shape=\(1, 2, 128, 64\) must be \[N, HV, V, K\]"):
        chunk_kda(**inputs, initial_state=np.zeros((1, 2, 128, 64), np.float32), state_v_first=True)


def test_transpose_state_layout_is_the_deprecated_state_v_first(rng):
    inputs = raw_inputs(rng, 8)
    inputs["g"] = -np.abs(inputs["g"])
    h0 = rng.standard_normal((1, VALUE_HEADS, DIM, DIM)).astype(np.float32)
    with pytest.warns(DeprecationWarning, match="`transpose_state_layout` is deprecated"):
        o, final = naive.fused_recurrent_kda(
            **inputs, initial_state=h0, output_final_state=True, transpose_state_layout=True
        )
    with pytest.raises(ValueError, match="Cannot pass both `state_v_first` and the deprecated"):
        naive.fused_recurrent_kda(**inputs, state_v_first=True, transpose_state_layout=True)
    o_v_first, final_v_first = naive.fused_recurrent_kda(
        **inputs, initial_state=h0, output_final_state=True, state_v_first=True
    )
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_v_first))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_v_first))
