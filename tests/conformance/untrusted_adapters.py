"""Adapters that attack the arbiter instead of computing KDA: each writes into what it is given, raises,
hangs, or returns something the contract does not allow. tests/conformance/test_untrusted.py runs each
through `python -m conformance run` and checks that the verdict, the exit code and the size of the
output are what they must be.

All of them are the numpy reference (`NumpyAdapter`, exact on the synthetic dump sets) with one change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from conformance.adapter import LayerResult
from tests.conformance.numpy_adapter import NumpyAdapter


class WrongRecurrentGDoubledInPlace(NumpyAdapter):
    """A wrong recurrent kernel (it uses g / 2) beside a right chunk kernel that then doubles the caller's
    g in place (through a flag it turns back on): were the suite to keep using that g, the wrong kernel
    would pass."""

    name = "attack: g doubled in place"

    def recurrent_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        return super().recurrent_kernel(q, k, v, g / 2, beta, cu_seqlens, initial_state)

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        result = super().chunk_kernel(q, k, v, g, beta, cu_seqlens, initial_state)
        g.flags.writeable = True
        g *= 2
        return result


class VScaledInPlace(NumpyAdapter):
    """A right chunk kernel that scales the caller's v by 1.01 in place (numpy refuses: read-only)."""

    name = "attack: v scaled in place"

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        result = super().chunk_kernel(q, k, v, g, beta, cu_seqlens, initial_state)
        np.multiply(v, 1.01, out=v)
        return result


class StateIntoInitialState(NumpyAdapter):
    """A right layer that writes its final states into the `initial_state` it was given, as serving code
    updates a state pool in place."""

    name = "attack: final state written into initial_state"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        result = super().layer_extend(hidden_states, cu_seqlens, initial_state, carry)
        if initial_state is not None:
            initial_state.flags.writeable = True
            initial_state[...] = result.final_state
        return result


class ConstructorRaises(NumpyAdapter):
    name = "attack: constructor raises"

    def __init__(self, config, weights, dtype, kernel="auto", *, options=None):
        raise RuntimeError("no device found for the implementation")


class EveryCallRaises(NumpyAdapter):
    name = "attack: every call raises"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        raise ValueError(f"cannot handle {len(cu_seqlens) - 1} sequences")

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        raise ValueError("kernel launch failed")

    recurrent_kernel = chunk_kernel


class Hangs(NumpyAdapter):
    name = "attack: the layer hangs"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        time.sleep(3600)
        raise AssertionError("unreachable")


class _OutChanged(NumpyAdapter):
    """The numpy reference with its layer output `out` passed through `changed`."""

    changed: ClassVar[Callable[[np.ndarray], Any]]

    def forward(self, x, cu_seqlens, carry):
        result = super().forward(x, cu_seqlens, carry)
        result.out = self.changed(result.out)
        return result


class ExtraAxis(_OutChanged):
    """`out` as [1, T, hidden]: numpy would broadcast it into the suite's [T, hidden] rows."""

    name = "attack: out with a leading axis"
    changed = staticmethod(lambda out: out[None])


class Float64Out(_OutChanged):
    name = "attack: out in float64"
    changed = staticmethod(lambda out: out.astype(np.float64))


class ListOut(_OutChanged):
    name = "attack: out as a list"
    changed = staticmethod(lambda out: out.tolist())


class NaNOut(_OutChanged):
    """A NaN in the output: a result out of tolerance, not a broken contract."""

    name = "broken: a NaN in the output"

    @staticmethod
    def changed(out: np.ndarray) -> np.ndarray:
        out = out.copy()
        out[-1, 0] = np.nan
        return out


class ReusedBuffers(NumpyAdapter):
    """A right layer that returns its one output buffer every time and overwrites it on the next call,
    as a serving stack reuses device buffers: the suite must have copied what it was given."""

    name = "numpy reference, one reused output buffer"

    def __init__(self, config, weights, dtype, kernel="auto", *, options=None):
        super().__init__(config, weights, dtype, kernel, options=options)
        self._buffer = np.zeros((0, config.hidden_size), np.float32)

    def forward(self, x, cu_seqlens, carry):
        result = super().forward(x, cu_seqlens, carry)
        if self._buffer.shape != result.out.shape:
            self._buffer = np.empty_like(result.out)
        self._buffer[...] = result.out
        return LayerResult(self._buffer, result.final_state, result.carry, result.intermediates)


class SlowLayer(NumpyAdapter):
    """The numpy reference, slowed down, that touches the file `marker` once it has answered a call: a
    test interrupts the run from outside once that file exists."""

    name = "numpy reference, slowed down"
    OPTIONS: ClassVar[dict[str, str]] = {"marker": "a file to create after the first call"}

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        result = super().layer_extend(hidden_states, cu_seqlens, initial_state, carry)
        Path(self.options["marker"]).touch()
        time.sleep(0.5)
        return result
