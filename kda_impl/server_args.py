"""Serving options that concern KDA models, and the guard on the ones they cannot use (RFC §2.2)."""

from __future__ import annotations

import dataclasses

from kda_spec.config import KDAConfig

# The conformance suite's serving scenarios that verify mixed chunks on the KDA backend
# (docs/serving.md): each request of a mixed EXTEND batch against itself alone and the float64 truth.
MIXED_CHUNK_EVIDENCE = (
    "serving-mixed-extend",
    "serving-one-token-extend",
    "serving-chunked-interleaved",
    "serving-permuted-slots",
)


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """The scheduler flags the KDA backend depends on.

    enable_mixed_chunk: prefill and decode requests in one EXTEND batch (sgl-jax's `mix_with_running`).
        Supported for KDA models: the backend continues every segment of a packed EXTEND batch from its
        own slot's recurrent and conv states, new requests from zeros, as the scenarios
        `MIXED_CHUNK_EVIDENCE` verify on every `conformance run`.
    """

    enable_mixed_chunk: bool = False

    def check_server_args(self, kda_config: KDAConfig | None) -> None:
        """Raise ValueError on a flag the model cannot serve; `kda_config` is None for a model without KDA.
        Every flag of this class is served by KDA models."""
