"""The inputs of one case, drawn from the run's seed and the case's place in the standard table.

Each case has its own random stream, so a run of a subset of the cases gives the same inputs for those
cases as the full run.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from kda_spec.config import KDAConfig
from kda_spec.dump_format import ALL_CASES, CaseSpec

# Streams 1 + i of the run's seed: case i of ALL_CASES, the standard twelve first (stream 0: the weights).
_CASE_STREAM_BASE = 1
# A normalised residual stream is about unit scale; a state a sequence carries in is smaller.
HIDDEN_STD = 1.0
INITIAL_STATE_STD = 0.25


@dataclasses.dataclass(frozen=True)
class CaseInputs:
    hidden_states: np.ndarray  # [T, hidden] float32
    cu_seqlens: np.ndarray  # [N+1] int32
    initial_state: np.ndarray | None  # [N, H, D, D] float32, or None
    packed: bool  # the reference sees one packed batch with cu_seqlens (the varlen cases)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence in the packed batch."""
        bounds = self.cu_seqlens.tolist()
        return list(itertools.pairwise(bounds))


def case_inputs(case: CaseSpec, config: KDAConfig, seed: int) -> CaseInputs:
    """The inputs of `case` (one of `ALL_CASES`) for the run seeded with `seed`."""
    rng = np.random.default_rng([seed, _CASE_STREAM_BASE + ALL_CASES.index(case)])
    hidden = (HIDDEN_STD * rng.standard_normal((case.total_tokens, config.hidden_size))).astype(np.float32)
    cu_seqlens = np.concatenate([[0], np.cumsum(case.seq_lens)]).astype(np.int32)
    initial_state = None
    if case.initial_state:
        shape = (len(case.seq_lens), config.num_heads, config.head_dim, config.head_dim)
        initial_state = (INITIAL_STATE_STD * rng.standard_normal(shape)).astype(np.float32)
    return CaseInputs(hidden, cu_seqlens, initial_state, packed=case.case_id.startswith("varlen_"))
