"""The server-start guard (`ServerArgs`) and the forward-time refusal read one table of forward modes."""

from __future__ import annotations

import types

import jax
import pytest

from kda_impl.layers.attention.linear.kda_backend import (
    FORWARD_MODES,
    KDAAttnBackend,
    RefusedMode,
    check_forward_mode,
)
from kda_impl.model_executor.forward_batch import ForwardMode
from kda_impl.server_args import ServerArgs

SPECULATIVE = ServerArgs(speculative_algorithm="EAGLE")


def _forward(backend: KDAAttnBackend, mode: ForwardMode) -> None:
    """The backend's forward on a batch of `mode`; a refused mode raises before any array is read."""
    backend.forward(None, types.SimpleNamespace(forward_mode=mode), *[None] * 7)


def test_every_forward_mode_is_in_the_table() -> None:
    assert set(FORWARD_MODES) == set(ForwardMode)
    served = {mode for mode, refused in FORWARD_MODES.items() if refused is None}
    assert served == {
        ForwardMode.EXTEND,
        ForwardMode.DECODE,
        ForwardMode.IDLE,
        ForwardMode.DUMMY_FIRST,
        ForwardMode.TARGET_VERIFY,
    }


@pytest.mark.parametrize("server_args", [ServerArgs(), ServerArgs(enable_mixed_chunk=True)])
def test_a_server_without_speculative_decoding_builds_its_backend(server_args: ServerArgs) -> None:
    backend = KDAAttnBackend(kernel="naive", server_args=server_args)
    assert jax.tree.map(lambda leaf: leaf, backend).kernel == "naive"  # a pytree as without server_args
    # Mixed chunks are EXTEND batches, which the backend serves (MIXED_CHUNK_EVIDENCE verifies it).
    assert set(server_args.flag_modes().values()) <= {(ForwardMode.EXTEND,)}


def test_speculative_decoding_is_accepted_when_the_backend_is_built() -> None:
    # TARGET_VERIFY is served (the serving scenarios SPECULATIVE_EVIDENCE verify it).
    assert SPECULATIVE.flag_modes() == {"speculative_algorithm='EAGLE'": (ForwardMode.TARGET_VERIFY,)}
    KDAAttnBackend(server_args=SPECULATIVE)
    SPECULATIVE.check_server_args()


def test_serving_a_mode_is_its_one_entry_for_the_guard_and_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        FORWARD_MODES, ForwardMode.TARGET_VERIFY, RefusedMode(NotImplementedError, "no drafts")
    )
    with pytest.raises(NotImplementedError, match=r"^TARGET_VERIFY: no drafts$"):
        _forward(KDAAttnBackend(), ForwardMode.TARGET_VERIFY)
    message = (
        r"^speculative_algorithm='EAGLE' .* TARGET_VERIFY batches, which the KDA backend refuses: no drafts$"
    )
    with pytest.raises(ValueError, match=message):
        KDAAttnBackend(server_args=SPECULATIVE)  # refused at start
    monkeypatch.setitem(FORWARD_MODES, ForwardMode.TARGET_VERIFY, None)
    KDAAttnBackend(server_args=SPECULATIVE)  # accepted at start
    check_forward_mode(ForwardMode.TARGET_VERIFY)  # and at the forward

    monkeypatch.setitem(FORWARD_MODES, ForwardMode.EXTEND, RefusedMode(RuntimeError, "withdrawn"))
    with pytest.raises(
        ValueError, match=r"^enable_mixed_chunk=True .* EXTEND batches, .* refuses: withdrawn$"
    ):
        KDAAttnBackend(server_args=ServerArgs(enable_mixed_chunk=True))
    with pytest.raises(RuntimeError, match=r"^EXTEND: withdrawn$"):
        _forward(KDAAttnBackend(), ForwardMode.EXTEND)
