"""Serving options that concern KDA models, and the guard on the ones they cannot use (RFC §2.2).

A server builds its KDA backend with its `ServerArgs` (`KDAAttnBackend(server_args=...)`), and the
backend checks them then: a flag that makes the scheduler send a forward mode the backend does not serve
(`kda_backend.FORWARD_MODES`, the same table its forward refuses modes by) stops the server at start,
with a ValueError naming the flag, the mode and why, instead of failing the first batch of that mode.
"""

from __future__ import annotations

import dataclasses

from kda_impl.layers.attention.linear.kda_backend import FORWARD_MODES
from kda_impl.model_executor.forward_batch import ForwardMode

# The conformance suite's serving scenarios that verify mixed chunks on the KDA backend
# (docs/serving.md): each request of a mixed EXTEND batch against itself alone and the float64 truth.
MIXED_CHUNK_EVIDENCE = (
    "serving-mixed-extend",
    "serving-one-token-extend",
    "serving-chunked-interleaved",
    "serving-permuted-slots",
)
# Those that verify speculative decoding's TARGET_VERIFY batches and accepts.
SPECULATIVE_EVIDENCE = ("serving-verify-handoff", "serving-poisoned-slots")


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """The scheduler flags the KDA backend depends on (sgl-jax's names).

    enable_mixed_chunk: prefill and decode requests in one EXTEND batch (sgl-jax's `mix_with_running`).
        Served: the backend continues every segment of a packed EXTEND batch from its own slot's
        recurrent and conv states, new requests from zeros, as the scenarios `MIXED_CHUNK_EVIDENCE`
        verify on every `conformance run`.
    speculative_algorithm: speculative decoding (`EAGLE`, `NGRAM`, ...; None: off). The target model
        then checks each step's draft tokens in a TARGET_VERIFY batch. Served: the backend steps each
        request's drafts from its slot into the pool's draft buffers and leaves the slot as it was until
        `RecurrentStatePool.accept_drafts`, as the scenarios `SPECULATIVE_EVIDENCE` verify.
    """

    enable_mixed_chunk: bool = False
    speculative_algorithm: str | None = None

    def flag_modes(self) -> dict[str, tuple[ForwardMode, ...]]:
        """The forward modes each flag that is set makes the scheduler send the model's attention
        backends, by flag (`name=value`); every server sends EXTEND, DECODE and IDLE batches."""
        modes: dict[str, tuple[ForwardMode, ...]] = {}
        if self.enable_mixed_chunk:
            modes["enable_mixed_chunk=True"] = (ForwardMode.EXTEND,)
        if self.speculative_algorithm is not None:
            modes[f"speculative_algorithm={self.speculative_algorithm!r}"] = (ForwardMode.TARGET_VERIFY,)
        return modes

    def check_server_args(self) -> None:
        """Raise ValueError on the first flag that brings a forward mode the KDA backend does not serve
        (`FORWARD_MODES`), naming the flag, the mode and why."""
        for flag, modes in self.flag_modes().items():
            for mode in modes:
                refused = FORWARD_MODES[mode]
                if refused is not None:
                    raise ValueError(
                        f"{flag} is not supported for KDA models: the scheduler would send {mode.name} "
                        f"batches, which the KDA backend refuses: {refused.reason}"
                    )
