"""The input space the search draws from: `SearchCase`, its hypothesis strategy, and its input arrays.

A case is a handful of small fields (hashable, shrinkable); its arrays are a pure function of them and
of the weights (`case_inputs`). What the fields span, and why (docs/search.md, "What is generated"):

- `seq_lens`: a packed batch of 1 to `max_seqs` sequences, `max_tokens` tokens at most, each length
  drawn from three families: any length (odd sizes), a multiple of `BOUNDARY` plus a small offset
  (sequences ending on, just before or just after a chunk boundary, and prefills ending there before a
  1- or 8-token decode), and three times a multiple of `BOUNDARY` plus a small offset (the suite's
  chunked prefill cuts a sequence in three: its split points then fall on a boundary);
- `init`: each sequence's initial recurrent state, zero, small or large;
- `scale_exp`: the hidden states' scale, 10^scale_exp, from where the l2 norm's and the RMSNorm's eps
  matter (1e-4) to large activations (100);
- `gate`, `beta`: the hidden states moved (least squares, per token) so that the gate's pre-activation
  `f` or beta's logit reach a regime: strong decay, almost none, beta near 0 or near 1;
- `weights`: which weight set (`weight_sets.weight_sets`: the dump's or the preset's, in every KDA
  family the implementation serves, each with a stress set), so also the family;
- `dtype`: the run, fp32 or bf16; `seed`: the random draws of the arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
from hypothesis import strategies as st

from conformance.checks.sequences import chunked_prefill_pieces
from kda_spec.config import KDAConfig
from kda_spec.families import canonical_weights

# Sequence lengths cluster around multiples of this: kda_impl's chunk (32) and fla's (64) both divide it
# or are multiples of it.
BOUNDARY = 32
BOUNDARY_OFFSETS = (0, -1, 1, -2, 2, 8)
MAX_TOKENS = 512
MAX_SEQS = 6  # with the padding sequence, one request bucket of 8 (kda_impl.model_executor.forward_batch)
SCALE_EXPONENTS = (-4, 2)  # hidden states from 1e-4 to 1e2
INITIAL_STATE_SCALES = {"zero": 0.0, "small": 0.1, "large": 10.0}
# The regimes' targets, per token: the gate's pre-activation `f + dt_bias` (softplus of 8 is 8: a decay
# of exp(-8 · exp(A_log)) per token; of -12, 6e-6: almost none; a lower-bound gate L·sigmoid(rate·8) is
# L to 3e-4, the gate at its floor, and L·sigmoid(-12·rate) about 0) and beta's logit (sigmoid of ±10:
# 4.5e-5 from 0 or 1).
GATE_TARGETS = {"natural": None, "strong": 8.0, "weak": -12.0}
BETA_TARGETS = {"natural": None, "near0": -10.0, "near1": 10.0}


@dataclasses.dataclass(frozen=True)
class SearchCase:
    """One generated case; `case_inputs` makes its arrays."""

    dtype: str
    weights: str
    seq_lens: tuple[int, ...]
    init: str = "zero"
    scale_exp: int = 0
    gate: str = "natural"
    beta: str = "natural"
    seed: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def describe(self) -> str:
        """One line: `fp32 stress [65, 3] init=large scale=1e-3 gate=strong beta=near1 seed=4`."""
        return (
            f"{self.dtype} {self.weights} {list(self.seq_lens)} init={self.init} scale=1e{self.scale_exp:+d} "
            f"gate={self.gate} beta={self.beta} seed={self.seed}"
        )

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "seq_lens": list(self.seq_lens)}


@dataclasses.dataclass(frozen=True)
class CaseInputs:
    """hidden_states [T, hidden] float32, cu_seqlens [N+1] int32, initial_state [N, H, D, D] float32 or
    None (zeros)."""

    hidden_states: np.ndarray
    cu_seqlens: np.ndarray
    initial_state: np.ndarray | None


def _fit(lengths: list[int], max_tokens: int) -> tuple[int, ...]:
    """`lengths` cut to `max_tokens` in all: the first sequences that fit, the last one shortened."""
    kept, room = [], max_tokens
    for n in lengths:
        if room <= 0:
            break
        kept.append(min(n, room))
        room -= kept[-1]
    return tuple(kept)


def lengths_strategy(max_tokens: int, max_seqs: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Packed batches: 1..max_seqs sequence lengths (module docstring), `max_tokens` in all."""
    blocks = max(1, max_tokens // BOUNDARY)
    offsets = st.sampled_from(BOUNDARY_OFFSETS)
    length = st.one_of(
        st.integers(1, max_tokens),
        st.builds(lambda m, d: max(1, BOUNDARY * m + d), st.integers(1, blocks), offsets),
        st.builds(lambda m, d: max(1, 3 * BOUNDARY * m + d), st.integers(1, max(1, blocks // 3)), offsets),
    )
    return st.lists(length, min_size=1, max_size=max_seqs).map(lambda lens: _fit(lens, max_tokens))


def case_strategy(
    dtypes: Sequence[str],
    weight_sets: Sequence[str],
    *,
    max_tokens: int = MAX_TOKENS,
    max_seqs: int = MAX_SEQS,
) -> st.SearchStrategy[SearchCase]:
    """Every field drawn independently; each shrinks towards its first value (the simplest case: one
    short sequence, zero state, unit scale, natural gate and beta, the first weight set and dtype)."""
    if max_tokens < 1 or max_seqs < 1:
        raise ValueError(f"max_tokens and max_seqs must be >= 1, got {max_tokens} and {max_seqs}")
    return st.builds(
        SearchCase,
        dtype=st.sampled_from(list(dtypes)),
        weights=st.sampled_from(list(weight_sets)),
        seq_lens=lengths_strategy(max_tokens, max_seqs),
        init=st.sampled_from(list(INITIAL_STATE_SCALES)),
        scale_exp=st.integers(*SCALE_EXPONENTS),
        gate=st.sampled_from(list(GATE_TARGETS)),
        beta=st.sampled_from(list(BETA_TARGETS)),
        seed=st.integers(0, 2**16),
    )


# A lower-bound kernel's tile (sgl-jax's and fla's chunk): a packed boundary inside one is the regime of
# sgl-jax PR #1587, a bounded gate's decay summed across the boundary before the mask.
TILE = 64


def regimes(case: SearchCase, config: KDAConfig) -> list[str]:
    """The regime labels a case on a layer of `config` counts under in the report (one case has
    several)."""
    labels = [case.dtype, f"weights:{case.weights}", f"family:{config.family}"]
    labels.append("packed" if len(case.seq_lens) > 1 else "single")
    if any(end % TILE for end in np.cumsum(case.seq_lens)[:-1]):
        labels.append("packed boundary inside a tile")
    if config.kda_family.lower_bound_gate and case.gate == "strong":
        labels.append("gate at its floor")
    offsets = {
        n % BOUNDARY if n % BOUNDARY <= BOUNDARY // 2 else n % BOUNDARY - BOUNDARY for n in case.seq_lens
    }
    if 0 in offsets:
        labels.append("ends on a boundary")
    if offsets & {-2, -1, 1, 2}:
        labels.append("ends 1-2 from a boundary")
    later_calls = chunked_prefill_pieces(case.seq_lens)[1:]
    if any(start % BOUNDARY == 0 for call in later_calls for start, _ in call):
        labels.append("prefill split on a boundary")
    labels += [f"init:{case.init}", f"scale:1e{case.scale_exp:+d}", f"gate:{case.gate}", f"beta:{case.beta}"]
    return labels


def case_inputs(case: SearchCase, weights: Mapping[str, np.ndarray], config: KDAConfig) -> CaseInputs:
    """The case's arrays: unit normal hidden states times 10^scale_exp, moved into the gate and beta
    regimes (`steered`), and normal initial states of the case's scale; all drawn from `case.seed`."""
    rng = np.random.default_rng([case.seed, case.tokens, len(case.seq_lens)])
    x = rng.standard_normal((case.tokens, config.hidden_size)) * 10.0**case.scale_exp
    x = steered(x, weights, config, GATE_TARGETS[case.gate], BETA_TARGETS[case.beta])
    cu = np.concatenate([[0], np.cumsum(case.seq_lens)]).astype(np.int32)
    state = None
    if case.init != "zero":
        shape = (len(case.seq_lens), config.num_heads, config.head_dim, config.head_dim)
        state = (rng.standard_normal(shape) * INITIAL_STATE_SCALES[case.init]).astype(np.float32)
    return CaseInputs(x.astype(np.float32), cu, state)


def steered(
    x: np.ndarray,  # [T, hidden] float64
    weights: Mapping[str, np.ndarray],
    config: KDAConfig,
    gate_target: float | None,
    beta_target: float | None,
) -> np.ndarray:
    """`x` [T, hidden] plus, per token, the least-norm change that brings the gate's pre-activation
    `f_b(f_a(x)) + dt_bias` [P] to `gate_target` and beta's logit `b_proj(x)` [H] to `beta_target` (as
    nearly as the projections' rank allows); `x` itself where both are None."""
    rows, targets = [], []
    if gate_target is not None:
        w = canonical_weights(config, weights)
        rows.append(np.asarray(w["f_b_proj.weight"], np.float64) @ w["f_a_proj.weight"])
        targets.append(gate_target - np.asarray(w["dt_bias"], np.float64))
    if beta_target is not None:
        rows.append(np.asarray(weights["b_proj.weight"], np.float64))
        targets.append(np.full(config.num_heads, beta_target))
    if not rows:
        return x
    matrix, target = np.concatenate(rows), np.concatenate(targets)
    change, *_ = np.linalg.lstsq(matrix, target[:, None] - matrix @ x.T, rcond=None)
    return x + change.T
