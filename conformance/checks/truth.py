"""The float64 truth a check's two sides are judged against.

docs/tolerance-policy.md, "Judged against the float64 truth", says how.

Layer results (the output, the final recurrent state, the intermediates) have their truth stored in
the dump by an independent float64 implementation of the layer: `<name>_fp64` for the fp32 run,
`<name>_bf16_fp64` for the bf16 run (`dump_format.truth_key`). Where a dump does not store it (a set
written by another tool or before the truth keys, or a case whose intermediates' truth was left out
for size) the checker runs the same implementation (`kda_spec.truth`) on the dump's own hidden states
and weights, rounded as that run rounded them: a pure function of data every dump carries. The kernels'
truth is not stored either: it is a pure function of the dumped kernel inputs, computed here by a
float64 recurrence (kda-layer.md step 6) on exactly the l2-normalised q, k, and the v, g, beta the
kernel under test gets.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from conformance.dumps.reader import CaseData
from conformance.judging.reduction import FP32_UNIT_ROUNDOFF
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.gradients import KERNEL_COTANGENT_KEYS, LAYER_COTANGENT_KEYS, kernel_cotangents
from kda_spec.gradients import layer_cotangents as seeded_layer_cotangents
from kda_spec.truth import (
    ReductionError,
    bf16_contract_rounding,
    layer_output_truth,
    layer_truth,
    layer_truths,
    mantissa_rounded,
    packed_delta_rule,
    run_hidden_states,
    run_weights,
)

KERNEL_INPUTS = ("q_after_conv", "k_after_conv", "v_after_conv", "g", "beta")
COMPUTED_LAYER_TRUTH_SOURCE = "float64 layer (kda_spec.truth) computed here on the dumped inputs and weights"
# The checker computes a case's layer truth itself up to this many tokens: every [T, H, D] float64
# array of it is 128 MiB at T = 4096 and the real size, and the layer holds about a dozen.
COMPUTE_MAX_TOKENS = 4096


CONTRACT_SOURCE = (
    "float64 layer (kda_spec.truth) rounding to bf16 at the precision contract's points, computed here "
    "on the dumped inputs and weights"
)
# The results the precision contract keeps in fp32 in a bf16 run (docs/bf16-rounding.md); every other
# result (the conv outputs, g_out, o_norm, out) it stores in bf16.
FP32_STAGES = ("g", "beta", "recurrent_state")


class NoTruth(Exception):
    """A check without a float64 truth, neither stored nor computed here; the message says why."""


def stored_truth(case: CaseData, name: str, dtype: str) -> np.ndarray:
    """The float64 truth of result `name` in the `dtype` run stored in the dump; `NoTruth` naming the key
    when it has none."""
    key = fmt.truth_key(name, dtype)
    value = case.arrays.get(key)
    if value is None:
        raise NoTruth(f"no truth in the dump ({key!r})")
    return value


def computed_layer_truth(
    case: CaseData, dtype: str, weights: Mapping[str, np.ndarray], config: KDAConfig
) -> dict[str, np.ndarray]:
    """The float64 truth of the layer results of the `dtype` run of `case`, by result name, computed from
    the dump's hidden states and float32 `weights` as dump_gen computes the stored one (`_computed_layer`
    says which results)."""
    return _computed_layer(case, dtype, weights, config, None)


# The model's spread: every value the contract's model rounds that lies within this relative distance of
# a bf16 rounding boundary is rounded to the other side: the one-ulp flips an fp32 pipeline's own
# accumulation order can make before it rounds to bf16, all at once.
SPREAD_RELATIVE_MOVE = 2.0**-23


def flipped_contract_rounding(array: np.ndarray) -> np.ndarray:
    """`array` rounded to bf16 as `bf16_contract_rounding` does, except that a value within
    `SPREAD_RELATIVE_MOVE` of a rounding boundary takes the bf16 neighbour on the boundary's other side."""
    nearest = bf16_contract_rounding(array)
    up = bf16_contract_rounding(array * (1 + SPREAD_RELATIVE_MOVE))
    down = bf16_contract_rounding(array * (1 - SPREAD_RELATIVE_MOVE))
    return np.where(up != nearest, up, down)


def computed_contract_model(
    case: CaseData, weights: Mapping[str, np.ndarray], config: KDAConfig, spread: bool = False
) -> dict[str, np.ndarray]:
    """The bf16 precision contract's float64 model of the layer results of the bf16 run of `case`, by
    result name: the layer in float64 rounding to bf16 exactly at the contract's points
    (`kda_spec.truth._layer`), on the dump's hidden states and float32 `weights` as the bf16 run sees
    them (`_computed_layer` says which results). With `spread`, every near-tie rounds the other way
    (`flipped_contract_rounding`): the model whose distance to the contract's is its spread."""
    rounding = flipped_contract_rounding if spread else bf16_contract_rounding
    return _computed_layer(case, "bf16", weights, config, rounding)


def computed_matmul_model(
    case: CaseData, weights: Mapping[str, np.ndarray], config: KDAConfig, mantissa_bits: int
) -> dict[str, np.ndarray]:
    """The float64 layer on the fp32 run of `case` with both operands of every projection rounded to
    `mantissa_bits` (a reduced-precision matmul pass: `conformance.judging.matmul_diagnosis`), by result
    name; `NoTruth` for a case over `COMPUTE_MAX_TOKENS` tokens."""
    if case.info.total_tokens > COMPUTE_MAX_TOKENS:
        raise NoTruth(f"no reduced-precision model of a case of over {COMPUTE_MAX_TOKENS} tokens")
    return layer_truth(
        run_weights(weights, "fp32", config),
        run_hidden_states(case.hidden_states, "fp32"),
        case.cu_seqlens,
        case.initial_state,
        config,
        operand=lambda array: mantissa_rounded(array, mantissa_bits),
    )


# The reductions' spread: this many float64 layers, each with its own random signs; their errors' root
# mean square is the spread, and their cross products say how many roundings decide a result
# (`conformance.judging.reduction.spread_of`). 28 pairs of 8 draws tell 1 effective rounding from 10.
SPREAD_DRAWS = 8


def spread_error(spread_lambda: float, rng: np.random.Generator) -> ReductionError:
    """The reduction error of the spread's model: `spread_lambda · u · scale` for each sum of products, its
    `kda_spec.truth.summation_scale`, with a sign drawn from `rng` (u = 2^-24)."""

    def error(scale: np.ndarray) -> np.ndarray:
        sign = rng.choice(np.array([-1.0, 1.0]), size=scale.shape)
        return spread_lambda * FP32_UNIT_ROUNDOFF * scale * sign

    return error


def computed_reduction_spread(
    case: CaseData,
    dtype: str,
    weights: Mapping[str, np.ndarray],
    config: KDAConfig,
    spread_lambda: float,
    draws: int = SPREAD_DRAWS,
) -> list[dict[str, np.ndarray]]:
    """`draws` float64 layers of the `dtype` run of `case`, each with every reduction outside the
    recurrence moved by its spread (`spread_error`; signs seeded by the case id and the draw): each draw's
    error against the same layer unmoved, by result name (the output, the final states and the
    intermediates), in float32 — how far faithful fp32 summation orders carry through the layer
    (docs/tolerance-policy.md, "The reductions' spread"). The layers run side by side (`layer_truths`).
    `NoTruth` for a case over `COMPUTE_MAX_TOKENS` tokens."""
    if case.info.total_tokens > COMPUTE_MAX_TOKENS:
        raise NoTruth(f"no reductions' spread of a case of over {COMPUTE_MAX_TOKENS} tokens")
    stream = zlib.crc32(case.info.case_id.encode())
    moved = [spread_error(spread_lambda, np.random.default_rng([stream, draw])) for draw in range(draws)]
    base, *layers = layer_truths(*_layer_arguments(case, dtype, weights, config), [None, *moved])
    names = ("out", "recurrent_state", *fmt.INTERMEDIATE_KEYS)
    return [{name: (layer[name] - base[name]).astype(np.float32) for name in names} for layer in layers]


def _computed_layer(
    case: CaseData,
    dtype: str,
    weights: Mapping[str, np.ndarray],
    config: KDAConfig,
    rounded: Callable[[np.ndarray], np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """`kda_spec.truth`'s layer on the `dtype` run's inputs of `case` (`rounded` as there): every result
    for a case of up to `COMPUTE_MAX_TOKENS` tokens; for a longer one (the `long` group) `out` and
    `recurrent_state` only, computed block by block (`layer_output_truth`), as dump_gen computes the long
    cases' stored truth."""
    args = _layer_arguments(case, dtype, weights, config)
    if case.info.total_tokens > COMPUTE_MAX_TOKENS:
        return layer_output_truth(*args, rounded=rounded)
    return layer_truth(*args, rounded=rounded)


def _layer_arguments(
    case: CaseData, dtype: str, weights: Mapping[str, np.ndarray], config: KDAConfig
) -> tuple[object, ...]:
    """The positional arguments of `kda_spec.truth`'s layer on the `dtype` run's inputs of `case`: the
    weights and hidden states that run saw, the sequences, the initial states, `config`."""
    return (
        run_weights(weights, dtype, config),
        run_hidden_states(case.hidden_states, dtype),
        case.cu_seqlens,
        case.initial_state,
        config,
    )


def gradient_cotangents(case: CaseData, dtype: str, config: KDAConfig) -> tuple[np.ndarray, np.ndarray]:
    """The cotangents (do [T, H, D], dht [N, H, D, D]) of a case's kernel gradient checks in the `dtype` run:
    the dump's (`grad_chunk_do`, `grad_chunk_dht`) where it stores them, else `kda_spec.gradients`' seeded
    ones (what dump_gen stores)."""
    return _cotangents(case, dtype, config, KERNEL_COTANGENT_KEYS, kernel_cotangents)


def layer_cotangents(case: CaseData, dtype: str, config: KDAConfig) -> tuple[np.ndarray, np.ndarray]:
    """The cotangents (dout [T, hidden], dht [N, H, D, D]) of a case's layer gradient checks in the `dtype`
    run: the dump's (`grad_layer_dout`, `grad_layer_dht`), else the seeded ones."""
    return _cotangents(case, dtype, config, LAYER_COTANGENT_KEYS, seeded_layer_cotangents)


def _cotangents(
    case: CaseData,
    dtype: str,
    config: KDAConfig,
    keys: tuple[str, str],
    seeded: Callable[[str, str, int, int, KDAConfig], tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    stored = [case.result(key, dtype) for key in keys]
    if all(array is not None for array in stored):
        return stored[0], stored[1]
    return seeded(case.info.case_id, dtype, case.info.total_tokens, len(case.info.seq_lens), config)


def not_computed(case: CaseData, name: str, what: str) -> NoTruth:
    """The `NoTruth` of a result `name` that `_computed_layer` leaves out of `what` for a long `case`."""
    return NoTruth(
        f"{what} of a case of {case.info.total_tokens} tokens (over the {COMPUTE_MAX_TOKENS} the checker "
        f"computes every result for) has no {name!r}: only 'out' and 'recurrent_state'"
    )


def recurrence_fp64(
    inputs: Sequence[np.ndarray],  # q, k (l2-normalised), v, g [T, H, D]; beta [T, H]
    cu_seqlens: np.ndarray,  # i32[N + 1]
    initial_state: np.ndarray | None,  # [N, H, D, D], or None: zeros
) -> tuple[np.ndarray, np.ndarray]:
    """The KDA recurrence in float64 on a packed batch (`kda_spec.truth.packed_delta_rule`, the dumps'
    own oracle), the `inputs` (`KERNEL_INPUTS`' order) widened exactly to float64 first. Returns o
    [T, H, D] and the final states [N, H, D, D], float64."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in inputs)
    state = None if initial_state is None else np.asarray(initial_state, np.float64)
    return packed_delta_rule(q, k, v, g, beta, cu_seqlens, state)
