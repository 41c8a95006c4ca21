"""Serving options that concern KDA models, and the guard on the ones they cannot use (RFC §2.2)."""

from __future__ import annotations

import dataclasses

from kda_spec.config import KDAConfig


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """The scheduler flags the KDA backend depends on.

    enable_mixed_chunk: prefill and decode requests in one EXTEND batch. Unverified with the chunk
        kernel's packed batches, so refused for KDA models. (Chunked prefill, a long prefill split into
        EXTEND steps, is supported: each step continues the request's states from its pool slot.)
    """

    enable_mixed_chunk: bool = False

    def check_server_args(self, kda_config: KDAConfig | None) -> None:
        """Raise ValueError on a flag the model cannot serve; `kda_config` is None for a model without KDA."""
        if kda_config is not None and self.enable_mixed_chunk:
            raise ValueError(
                f"--enable-mixed-chunk is not supported with KDA (linear attention) models "
                f"(preset {kda_config.preset!r}): mixing prefill and decode segments in one chunk-kernel "
                f"batch is unverified. Drop the flag; chunked prefill (--chunked-prefill-size) stays "
                f"available."
            )
