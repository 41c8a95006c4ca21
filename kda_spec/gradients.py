"""The gradients a dump may carry and the checker judges: their cotangents, names and shapes.

numpy only. The gradient checks (docs/gradients.md) differentiate `sum(o * do) + sum(final_state * dht)`
of the chunk kernel and `sum(out * dout) + sum(final_state * dht)` of the layer, for cotangents drawn
from the case's id and the run's dtype (`kernel_cotangents`, `layer_cotangents`): the same on every
machine, for the writer (dump_gen, which stores them beside the reference's gradients) and for the checker
(which uses the stored ones where a dump has them). A layer's gradients are named by their check's result
(`layer_gradient_results`): `dx`, `dh0`, and `d<weight>` for every canonical weight, a fused conv's
gradient split exactly into its q, k and v thirds.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.families import canonical_weight_shapes, canonical_weights
from kda_spec.layer_vjp import HIDDEN_STATES_GRADIENT, INITIAL_STATE_GRADIENT
from kda_spec.truth import GRADIENT_NAMES

if TYPE_CHECKING:
    from kda_spec.dump_format import CaseSpec

# The canonical weights whose gradients the layer's checks judge, by name without `.weight` (any config
# has the same names: a preset's).
LAYER_GRADIENT_WEIGHTS = tuple(
    name.removesuffix(".weight")
    for name in canonical_weight_shapes(KDAConfig(hidden_size=1, num_heads=1, head_dim=1))
)
# The results of a layer's vjp, by check result: the input's, the initial states', each weight's.
LAYER_GRADIENT_RESULTS = ("dx", "dh0", *(f"d{name}" for name in LAYER_GRADIENT_WEIGHTS))

# dump_gen stores the reference's gradients, unless told which cases (`--gradient-cases`), for the cases of
# at most this many tokens: a layer's weight gradients are as large as its weights whatever the case (600
# KiB a run at the mini size, 160 MiB at the real size), so a set carries them for its short cases.
GRADIENTS_MAX_TOKENS = 65


def default_gradient_cases(cases: Sequence[CaseSpec]) -> tuple[str, ...]:
    """The ids of `cases` dump_gen stores the reference's gradients of by default: those of at most
    `GRADIENTS_MAX_TOKENS` tokens, none of a long group."""
    return tuple(c.case_id for c in cases if c.group is None and c.total_tokens <= GRADIENTS_MAX_TOKENS)


# A dump's gradient keys, each the name of a result of a run (suffix `_bf16` in the bf16 run,
# `dump_format.result_key`): the chunk kernel's cotangents and reference gradients, the layer's.
KERNEL_COTANGENT_KEYS = ("grad_chunk_do", "grad_chunk_dht")
KERNEL_GRADIENT_KEYS = tuple(f"grad_chunk_{name}" for name in GRADIENT_NAMES)
LAYER_COTANGENT_KEYS = ("grad_layer_dout", "grad_layer_dht")
LAYER_GRADIENT_KEYS = tuple(f"grad_layer_{name}" for name in LAYER_GRADIENT_RESULTS)
GRADIENT_KEYS = (*KERNEL_COTANGENT_KEYS, *KERNEL_GRADIENT_KEYS, *LAYER_COTANGENT_KEYS, *LAYER_GRADIENT_KEYS)
# Those a bf16 run stores in float32: the cotangents, the kernel's (an fp32 backward on fp32 inputs in both
# runs), the states' (`dh0`).
FP32_GRADIENT_KEYS = frozenset(
    {*KERNEL_COTANGENT_KEYS, *KERNEL_GRADIENT_KEYS, *LAYER_COTANGENT_KEYS, "grad_layer_dh0"}
)


def gradient_key_shapes(tokens: int, num_seqs: int, config: KDAConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every gradient key of a case of `tokens` tokens in `num_seqs` sequences."""
    hidden, heads, dim = config.hidden_size, config.num_heads, config.head_dim
    per_token, state = (tokens, heads, dim), (num_seqs, heads, dim, dim)
    weights = canonical_weight_shapes(config)
    kernel = {"dq": per_token, "dk": per_token, "dv": per_token, "dg": per_token, "dbeta": (tokens, heads)}
    return {
        "grad_chunk_do": per_token,
        "grad_chunk_dht": state,
        **{f"grad_chunk_{name}": shape for name, shape in {**kernel, "dh0": state}.items()},
        "grad_layer_dout": (tokens, hidden),
        "grad_layer_dht": state,
        "grad_layer_dx": (tokens, hidden),
        "grad_layer_dh0": state,
        **{f"grad_layer_d{name.removesuffix('.weight')}": shape for name, shape in weights.items()},
    }


def kernel_cotangents(
    case_id: str, dtype: str, tokens: int, num_seqs: int, config: KDAConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The chunk kernel's cotangents of a case: do [T, H, D] of its output and dht [N, H, D, D] of its final
    states, float32 N(0, 1), seeded by the case id and the run's dtype."""
    rng = _stream(case_id, dtype)
    heads, dim = config.num_heads, config.head_dim
    do = rng.standard_normal((tokens, heads, dim), np.float32)
    return do, rng.standard_normal((num_seqs, heads, dim, dim), np.float32)


def layer_cotangents(
    case_id: str, dtype: str, tokens: int, num_seqs: int, config: KDAConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The layer's cotangents of a case: dout [T, hidden] of its output and dht [N, H, D, D] of its final
    states, float32 N(0, 1), seeded by the case id, the run's dtype and "layer" (apart from the kernel's)."""
    rng = _stream(case_id, dtype, "layer")
    heads, dim = config.num_heads, config.head_dim
    dout = rng.standard_normal((tokens, config.hidden_size), np.float32)
    return dout, rng.standard_normal((num_seqs, heads, dim, dim), np.float32)


def _stream(case_id: str, dtype: str, *labels: str) -> np.random.Generator:
    """The random stream of a case's cotangents in the `dtype` run, apart for each `labels`."""
    return np.random.default_rng([zlib.crc32(text.encode()) for text in (case_id, dtype, *labels)])


def layer_gradient_results(grads: Mapping[str, np.ndarray], config: KDAConfig) -> dict[str, np.ndarray]:
    """A layer vjp's gradients (`kda_spec.layer_vjp`'s names: the family's weights, `hidden_states`,
    `initial_state`) by `LAYER_GRADIENT_RESULTS` name (a fused conv's gradient split exactly)."""
    canonical = canonical_weights(config, grads)
    return {
        "dx": grads[HIDDEN_STATES_GRADIENT],
        "dh0": grads[INITIAL_STATE_GRADIENT],
        **{f"d{name.removesuffix('.weight')}": value for name, value in canonical.items()},
    }
