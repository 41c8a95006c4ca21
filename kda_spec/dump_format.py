"""Dump format v1: the names, shapes and encodings shared by the writer (`dump_gen`) and the reader.

numpy only. See docs/dump-format.md for the prose version of this contract.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.gradients import FP32_GRADIENT_KEYS, GRADIENT_KEYS, gradient_key_shapes
from kda_spec.weight_names import hf_weight_shapes

FORMAT_NAME = "kda-dump"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.npz"
CASES_DIR = "cases"


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """One dump case: the sequence lengths of its packed batch and whether it starts from a state.

    `group`: the optional group the case belongs to (`CASE_GROUPS`), None for the standard and extra
    cases; `decode_steps`: how many of its last tokens the checker decodes one by one after a prefill
    of the rest (0: the checker's usual prefill→decode checks only).
    """

    case_id: str
    seq_lens: tuple[int, ...]
    initial_state: bool = False
    group: str | None = None
    decode_steps: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def file(self) -> str:
        return case_file(self.case_id)


# RFC §6.1: the twelve cases, in this order.
STANDARD_CASES: tuple[CaseSpec, ...] = (
    CaseSpec("T1", (1,)),
    CaseSpec("T8", (8,)),
    CaseSpec("T64", (64,)),
    CaseSpec("T65", (65,)),
    CaseSpec("T128", (128,)),
    CaseSpec("T256", (256,)),
    CaseSpec("T1024", (1024,)),
    CaseSpec("varlen_balanced_4x32", (32, 32, 32, 32)),
    CaseSpec("varlen_unbalanced_5_17_1_41", (5, 17, 1, 41)),
    CaseSpec("varlen_single_T128", (128,)),
    CaseSpec("single_T128_initstate", (128,), initial_state=True),
    CaseSpec("varlen_initstate", (5, 17, 1, 41), initial_state=True),
)
# Optional cases, only made when named (`--cases`): odd lengths that no chunk size divides, for the
# strong-decay (`--weights stress`) sets.
EXTRA_CASES: tuple[CaseSpec, ...] = (
    CaseSpec("T333", (333,)),
    CaseSpec("varlen_70_3", (70, 3)),
)
# The optional `long` group, only made when named (`--cases long`): contexts far past the RFC's 1024
# tokens, where the recurrent state's error accumulates. A long case stores the layer output and the
# final states but not the per-token kernel outputs or the intermediates (LONG_RESULT_NAMES), and only
# the output's and the states' float64 truth. The decode case is one sequence of 8192 + 512 tokens; the
# checker prefills the first 8192 and decodes the last 512 one by one from the carried state.
LONG_GROUP = "long"
LONG_CASES: tuple[CaseSpec, ...] = (
    CaseSpec("long_T16384", (16384,), group=LONG_GROUP),
    CaseSpec("long_prefill8192_decode512", (8192 + 512,), group=LONG_GROUP, decode_steps=512),
)
CASE_GROUPS: dict[str, tuple[CaseSpec, ...]] = {LONG_GROUP: LONG_CASES}
ALL_CASES: tuple[CaseSpec, ...] = STANDARD_CASES + EXTRA_CASES + LONG_CASES
CASES_BY_ID: dict[str, CaseSpec] = {case.case_id: case for case in ALL_CASES}


def select_cases(case_ids: list[str] | None) -> tuple[CaseSpec, ...]:
    """The cases named by `case_ids`, a group name (`long`) standing for its cases in order (the standard
    twelve when None); a ValueError names the unknown."""
    if not case_ids:
        return STANDARD_CASES
    unknown = [name for name in case_ids if name not in CASES_BY_ID and name not in CASE_GROUPS]
    if unknown:
        raise ValueError(
            f"unknown case id(s) {unknown}; known cases: {list(CASES_BY_ID)}; groups: {list(CASE_GROUPS)}"
        )
    selected: list[CaseSpec] = []
    for name in case_ids:
        for case in CASE_GROUPS.get(name, (CASES_BY_ID.get(name),)):
            if case not in selected:
                selected.append(case)
    return tuple(selected)


# Input keys of a case file.
INPUT_KEYS = ("hidden_states", "cu_seqlens", "initial_recurrent_state")

# Result keys of the fp32 run; the bf16 run writes `out_bf16` and every other key with suffix `_bf16`.
OUTPUT_KEY = "out"
KERNEL_KEYS = (
    "o_kda_chunk",
    "recurrent_state_chunk",
    "o_kda_fused_recurrent",
    "recurrent_state_fused_recurrent",
)
INTERMEDIATE_KEYS = ("q_after_conv", "k_after_conv", "v_after_conv", "g", "beta", "g_out", "o_norm")
# The gate's pre-activation input `f_b_proj(f_a_proj(x))` [T, H, D], before dt_bias and the activation:
# the raw gate the kernels' raw-gate form (`use_gate_in_kernel`) takes. Written by dump_gen since
# issue 42; a format-v1 set written before lacks it, and the checks that need it are then skipped.
GATE_INPUT_KEY = "g_raw"
# Intermediates a format-v1 set may lack (it was written before them).
OPTIONAL_INTERMEDIATE_KEYS = (GATE_INPUT_KEY,)
OPTIONAL_KEYS = ("final_conv_state",)
# The gradients (kda_spec.gradients, docs/gradients.md): each run's cotangents and the reference's
# gradients of the chunk kernel and of the layer, for the cases dump_gen stores them for; optional.
GRADIENT_RESULT_KEYS = GRADIENT_KEYS
# What a long case stores of each run: the output and the final states, not the [T, H, D] results.
LONG_RESULT_NAMES = (OUTPUT_KEY, "recurrent_state_chunk", "recurrent_state_fused_recurrent")
# Keys that stay float32 in a bf16 run (states and the fp32 gate path, the fp32 gradients).
FP32_IN_BF16_RUN = frozenset(
    {"recurrent_state_chunk", "recurrent_state_fused_recurrent", "g", "beta", *FP32_GRADIENT_KEYS}
)
DTYPES = ("fp32", "bf16")


def case_file(case_id: str) -> str:
    """A case's file in the set: `cases/<id>.npz` (a reader refuses any other)."""
    return f"{CASES_DIR}/{case_id}.npz"


def result_key(name: str, dtype: str) -> str:
    """The stored key of result `name` ("out", "o_kda_chunk", ...) in the run of `dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if name == OUTPUT_KEY:
        return f"out_{dtype}"
    return name if dtype == "fp32" else f"{name}_bf16"


# The float64 truth ("oracle") of each run: the layer computed again in float64 from exactly the inputs
# and weights that run saw (kda_spec.truth). `recurrent_state` is the layer's final state per sequence.
TRUTH_NAMES = (OUTPUT_KEY, "recurrent_state", *INTERMEDIATE_KEYS, *OPTIONAL_INTERMEDIATE_KEYS)
TRUTH_DTYPE = "float64"


def truth_key(name: str, dtype: str) -> str:
    """The stored key of the float64 truth of `name` for the run of `dtype`: `out_fp64`, `g_bf16_fp64`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if name not in TRUTH_NAMES:
        raise ValueError(f"no truth is stored for {name!r}; truth names: {list(TRUTH_NAMES)}")
    return f"{name}_fp64" if dtype == "fp32" else f"{name}_bf16_fp64"


def split_truth_key(key: str) -> tuple[str, str] | None:
    """(name, dtype of the run) of a truth key, or None for any other key."""
    for dtype in DTYPES:
        for name in TRUTH_NAMES:
            if key == truth_key(name, dtype):
                return name, dtype
    return None


def expected_shape(name: str, *, tokens: int, num_seqs: int, config: dict) -> tuple[int, ...]:
    """Shape of result, truth or input `name` (without suffix) for a case of `tokens` and `num_seqs`."""
    hidden, heads, dim = config["hidden_size"], config["num_heads"], config["head_dim"]
    width = config["conv_size"]
    shapes = {
        "hidden_states": (tokens, hidden),
        "cu_seqlens": (num_seqs + 1,),
        "initial_recurrent_state": (num_seqs, heads, dim, dim),
        "out": (tokens, hidden),
        "o_kda_chunk": (tokens, heads, dim),
        "o_kda_fused_recurrent": (tokens, heads, dim),
        "recurrent_state_chunk": (num_seqs, heads, dim, dim),
        "recurrent_state_fused_recurrent": (num_seqs, heads, dim, dim),
        "recurrent_state": (num_seqs, heads, dim, dim),
        "q_after_conv": (tokens, heads, dim),
        "k_after_conv": (tokens, heads, dim),
        "v_after_conv": (tokens, heads, dim),
        "g": (tokens, heads, dim),
        GATE_INPUT_KEY: (tokens, heads, dim),
        "beta": (tokens, heads),
        "g_out": (tokens, heads, dim),
        "o_norm": (tokens, heads, dim),
        "final_conv_state": (num_seqs, width - 1, 3 * heads * dim),
    }
    if name in GRADIENT_RESULT_KEYS:
        return gradient_key_shapes(tokens, num_seqs, KDAConfig.from_manifest(config))[name]
    if name not in shapes:
        raise KeyError(f"no shape rule for dump key {name!r}")
    return shapes[name]


# Weight names (HF checkpoint names without the `model.layers.{i}.self_attn.` prefix), torch layout.
def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """weights.npz's keys and shapes for a manifest `config` block (the HF names of one KDA layer)."""
    return hf_weight_shapes(KDAConfig.from_manifest(config))


# --- bf16 bit encoding: a uint16 array holds raw bfloat16 bits -------------------------------------


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Decode raw bfloat16 bits (uint16) to float32, exactly."""
    if bits.dtype != np.uint16:
        raise TypeError(f"expected uint16 bfloat16 bits, got dtype {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Encode float32 values that are already bf16-representable as raw bits (exact; no rounding)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    words = values.view(np.uint32)
    if np.any(words & 0xFFFF):
        raise ValueError("values are not bfloat16-representable; round them to bf16 before encoding")
    return (words >> 16).astype(np.uint16)


def stored_result(array: np.ndarray, name: str, dtype: str) -> np.ndarray:
    """Result `name` of the `dtype` run as a set stores it: raw bf16 bits in a bf16 run (values already
    bf16-representable), float32 otherwise and for the keys that stay float32 (`FP32_IN_BF16_RUN`)."""
    if dtype == "bf16" and name not in FP32_IN_BF16_RUN:
        return float32_to_bf16_bits(array)
    return np.asarray(array, np.float32)


def decode_array(array: np.ndarray) -> np.ndarray:
    """A stored array as float32 (uint16 → bf16 bits decoded), ints untouched."""
    if array.dtype == np.uint16:
        return bf16_bits_to_float32(array)
    return array


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The manifest's optional `precision` block (docs/dump-format.md, "manifest.json"): how the reference's
# fp32 arithmetic ran, as read back at run time. A set without it (made before it) is judged by its
# reference's device: IEEE fp32 on a CPU, unknown on a CUDA device.
PRECISION_BLOCK = "precision"
TRITON_F32_DEFAULT = "TRITON_F32_DEFAULT"  # the variable Triton's fp32 `tl.dot` default reads
IEEE_TRITON_F32 = "ieee"
