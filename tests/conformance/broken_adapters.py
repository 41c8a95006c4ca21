"""kda_impl broken on purpose, to prove that the checks catch each kind of bug.

Each adapter changes one thing of the built-in `KDAImplAdapter` and keeps the rest of its serving
path: the decay gate's sign, beta's sigmoid computed in bf16, the conv's respect for sequence
boundaries, the conv state carried into decode, the output by 1e-4, or the final state by a gain
(`state_scaled`). The beta and conv-state defects are `conformance.adapters.defects`' (which `python -m
conformance power` injects too). The first three swap the layer or backend class the adapter builds its
serving path from.

The `Numpy*` ones break the numpy reference instead (no compilation, for the quick `diff` tests): the
gate's sign, a decode that goes off from its fourth step (with or without its intermediates), beta
rounded to bf16 where the precision contract keeps it fp32, a chunked prefill's conv window one token
off after a split, and kernels with no layer path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from conformance.adapters.defects import BetaSigmoidInRunDtype, without_conv_state
from conformance.adapters.kda_impl_adapter import KDACarry, KDAImplAdapter
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.layers.short_conv import short_conv_with_state
from kda_impl.models.kimi_linear import KimiDeltaAttention
from tests.conformance.numpy_adapter import NumpyAdapter, NumpyCarry


class _FlippedDecay(KimiDeltaAttention):
    def _decay(self, x: jax.Array) -> jax.Array:
        return -super()._decay(x)


class FlippedGate(KDAImplAdapter):
    name = "broken: decay gate sign flipped"
    layer_class = _FlippedDecay


class BetaInBf16(KDAImplAdapter):
    name = "broken: beta's sigmoid in the run dtype (bf16), not fp32"
    layer_class = BetaSigmoidInRunDtype


@jax.tree_util.register_pytree_node_class
class _LeakyConvBackend(KDAAttnBackend):
    def apply_short_conv(self, layer, forward_batch, mixed_qkv, conv_weight, recurrent_state_pool):
        _, new_state = super().apply_short_conv(
            layer, forward_batch, mixed_qkv, conv_weight, recurrent_state_pool
        )
        # The packed batch convolved as one sequence: each sequence sees the tail of the one before.
        no_state = jnp.zeros((1, conv_weight.shape[0] - 1, mixed_qkv.shape[1]), mixed_qkv.dtype)
        leaked, _ = short_conv_with_state(
            mixed_qkv, conv_weight, no_state, jnp.array([0, mixed_qkv.shape[0]], jnp.int32)
        )
        return leaked, new_state


class LeakyConv(KDAImplAdapter):
    name = "broken: conv leaks across sequences"
    backend_class = _LeakyConvBackend


class DecodeDropsConvState(KDAImplAdapter):
    name = "broken: decode forgets the conv state"

    def layer_decode(self, hidden_states: np.ndarray, carry: KDACarry):
        return super().layer_decode(hidden_states, without_conv_state(carry))


class OutputOffset(KDAImplAdapter):
    name = "broken: output off by 1e-4"

    def layer_extend(self, *args, **kwargs):
        return self._offset(super().layer_extend(*args, **kwargs))

    def layer_decode(self, *args, **kwargs):
        return self._offset(super().layer_decode(*args, **kwargs))

    @staticmethod
    def _offset(result):
        result.out = result.out + np.float32(1e-4)
        return result


def state_scaled(gain: float) -> type[KDAImplAdapter]:
    """kda_impl whose layer returns its final state times `gain` (its carry, and so decode, unchanged): a
    state off by a relative gain error of `gain - 1`, the defect issue 49 holds the reductions' spread to."""

    class StateScaled(KDAImplAdapter):
        name = f"broken: final state scaled by {gain:.9g}"

        def layer_extend(self, *args, **kwargs):
            result = super().layer_extend(*args, **kwargs)
            return dataclasses.replace(result, final_state=result.final_state * np.float32(gain))

    return StateScaled


class NumpyFlippedGate(NumpyAdapter):
    """The gate bug in the numpy reference: no compilation, for the quick command-line tests."""

    name = "broken: decay gate sign flipped (numpy)"

    def gate(self, f: np.ndarray) -> np.ndarray:
        return -super().gate(f)

    def forward(self, x, cu_seqlens, carry):
        with np.errstate(over="ignore", invalid="ignore"):  # the state blows up, as it would
            return super().forward(x, cu_seqlens, carry)


@dataclasses.dataclass
class _CountedCarry(NumpyCarry):
    decode_steps: int = 0  # the decode steps this carry's sequences have taken


class NumpyDecodeOffAfterSteps(NumpyAdapter):
    """From the fourth decode step of a carry on (step 3), each decoded token's hidden state is 5% too
    large: the prefill, the first three decode steps and every prefill-only check are right."""

    name = "broken: decode off from its fourth step (numpy)"
    good_steps = 3

    def layer_decode(self, hidden_states, carry):
        steps = getattr(carry, "decode_steps", 0)
        x = hidden_states if steps < self.good_steps else hidden_states * np.float32(1.05)
        result = super().layer_decode(x, carry)
        counted = _CountedCarry(result.carry.conv_state, result.carry.recurrent_state, steps + 1)
        return dataclasses.replace(result, carry=counted)


class NumpyDecodeOffNoIntermediates(NumpyDecodeOffAfterSteps):
    """`NumpyDecodeOffAfterSteps`, its decode steps returning no intermediates."""

    name = "broken: decode off from its fourth step, no decode intermediates (numpy)"

    def layer_decode(self, hidden_states, carry):
        return dataclasses.replace(super().layer_decode(hidden_states, carry), intermediates={})


class NumpyDecodeRaises(NumpyAdapter):
    """Its decode path raises: a fault of the implementation in the checks outside diff's stage table."""

    name = "broken: decode raises (numpy)"

    def layer_decode(self, hidden_states, carry):
        raise RuntimeError("decode exploded")


class NumpyBetaRoundedToBf16(NumpyAdapter):
    """beta's sigmoid rounded to the run dtype (bf16), where the precision contract keeps it fp32."""

    name = "broken: beta rounded to bf16 (numpy)"

    def forward(self, x, cu_seqlens, carry):
        result = super().forward(x, cu_seqlens, carry)
        result.intermediates["beta"] = self.cast(result.intermediates["beta"])
        return result


class NumpyConvOffAfterSplit(NumpyAdapter):
    """A prefill continuing a carry (the next piece of a chunked prefill) reads the carried conv window
    one token off: the oldest position zeroed, the newest input lost."""

    name = "broken: conv window off by one after a split (numpy)"

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        if carry is not None:
            conv = carry.conv_state
            shifted = np.concatenate([np.zeros_like(conv[:, :1]), conv[:, :-1]], axis=1)
            carry = dataclasses.replace(carry, conv_state=shifted)
        return super().layer_extend(hidden_states, cu_seqlens, initial_state, carry)
