"""Speculative verify on kda_impl's real path (sglang PR #26888's check): N draft tokens verified in one
TARGET_VERIFY forward, then `RecurrentStatePool.accept_drafts(n)`, give for every n = 0..N the outputs
of the first n drafts and the slot states (recurrent state and conv window) of n sequential DECODE
forwards of the same tokens; and a decode after the accept continues as the sequential decodes do.
`KDAAttnBackend`, `RecurrentStatePool` and `jit_forward` (pool donated), fp32, both KDA families.

Tolerance. The conv window is data movement of the same projections (each token's q | k | v conv
inputs): equal to the bit. The recurrent states and outputs are not the same computation: the verify
steps each draft with the recurrent prefill kernel on one-token sequences, a decode with the decode
kernel on the pool's slots, so they round apart. Each is held to the distance between the two paths no
larger than twice the sequential decodes' own largest error against the float64 truth of the same
tokens (`kda_spec.truth.layer_truth`): the relative gate's factor 2 (conformance/tolerances.toml,
[relative.fp32]), no absolute number. Measured on this test's data (`mini`, `glm5-next-mini`, N = 4,
a 37-token prompt): the verify and the decodes differ by at most 1.2e-7 in the states (the decodes up
to 3.9e-7 from float64), 6.0e-7 in the outputs (decodes up to 9.5e-7 from float64), 3.6e-7 in the
decode after the accept: at most 0.35 of the bound (mini's first drafts' outputs). Accepting one draft
fewer than asked fails 8 of the 10 accept tests (a conv window one token off, a state one token back).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kda_impl.model_executor.forward_batch import ForwardMode
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.truth import layer_truth
from tests.kda_impl.conftest import CONFIGS, LayerRunner, random_tokens

DRAFTS = 4  # N
PROMPT = 37  # tokens prefilled before the drafts
FACTOR = 2.0  # the relative gate's factor (conformance/tolerances.toml, [relative.fp32])
FAMILY_PRESETS = ("mini", "glm5-next-mini")


def assert_within_twice_the_decodes_error(
    verified: np.ndarray, decoded: np.ndarray, truth: np.ndarray, what: str
) -> None:
    """`verified` no further from `decoded` than FACTOR x the decodes' largest error against the float64
    `truth` (all one shape)."""
    distance = float(np.max(np.abs(np.asarray(verified, np.float64) - decoded)))
    decode_error = float(np.max(np.abs(np.asarray(decoded, np.float64) - truth)))
    assert np.all(np.isfinite(verified)), f"{what}: non-finite values"
    assert distance <= FACTOR * decode_error, (
        f"{what}: verify and decodes {distance:.3g} apart, over {FACTOR} x the decodes' error against "
        f"float64 ({decode_error:.3g})"
    )


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def served(request: pytest.FixtureRequest) -> dict:
    """One preset served both ways from the same prompt: one slot decoding the N drafts and one more
    token one at a time, and N + 1 slots that verify the N drafts in one forward, slot n accepting n of
    them and then decoding token n; with the float64 truth of every prefix."""
    config = CONFIGS[request.param]
    weights = synthetic_weights(config, seed=0)
    runner = LayerRunner(config, weights, jnp.float32)  # its own: the shared runners have no draft buffers
    runner.pool = runner.pool.with_draft_tokens(DRAFTS)
    rng = np.random.default_rng(26888)
    prompt, tokens = random_tokens(rng, config, PROMPT), random_tokens(rng, config, DRAFTS + 1)

    sequential = runner.alloc(1)
    runner.extend([prompt], sequential)
    decode_states, decode_outs = [runner.states(sequential)], []
    for token in tokens:
        decode_outs.append(runner.decode(token[None], sequential)[0])
        decode_states.append(runner.states(sequential))

    verifying = runner.alloc(DRAFTS + 1)
    runner.extend([prompt] * (DRAFTS + 1), verifying)
    before = runner.states(verifying)
    batch = runner.batch(ForwardMode.TARGET_VERIFY, [DRAFTS] * (DRAFTS + 1), verifying)
    verify = runner.run(batch, [tokens[:DRAFTS]] * (DRAFTS + 1))
    after_verify = runner.states(verifying)
    runner.pool = runner.pool.accept_drafts(verifying, list(range(DRAFTS + 1)))
    accepted = runner.states(verifying)
    decoded_on = runner.decode(tokens, verifying)  # slot n decodes token n: the one after its n drafts

    sequence = np.concatenate([prompt, tokens])
    truths = [
        layer_truth(weights, sequence[: PROMPT + n], np.array([0, PROMPT + n]), None, config)
        for n in range(1, DRAFTS + 2)
    ]
    truth_states = [layer_truth(weights, prompt, np.array([0, PROMPT]), None, config)["recurrent_state"]]
    truth_states += [truth["recurrent_state"] for truth in truths[:DRAFTS]]
    return {
        "decode_states": decode_states,  # n -> (recurrent [1, H, D, D], conv [1, W-1, 3, P]) after n
        "decode_outs": np.stack(decode_outs),  # [N + 1, hidden]
        "before": before,
        "after_verify": after_verify,
        "verify_outs": verify.outs,  # request n -> [N, hidden]
        "accepted": accepted,  # (recurrent [N + 1, ...], conv [N + 1, ...]): slot n kept n drafts
        "decoded_on": decoded_on,  # [N + 1, hidden]
        "truth_outs": truths[-1]["out"][PROMPT:],  # [N + 1, hidden] of the prompt's next N + 1 tokens
        "truth_states": [state[0] for state in truth_states],  # n -> [H, D, D] after PROMPT + n tokens
    }


def test_a_verify_leaves_every_slot_as_it_was(served: dict) -> None:
    for before, after in zip(served["before"], served["after_verify"]):
        np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize("n", range(DRAFTS + 1))
def test_accepting_n_drafts_is_n_sequential_decodes(served: dict, n: int) -> None:
    recurrent, conv = (states[n] for states in served["accepted"])
    decoded_recurrent, decoded_conv = (states[0] for states in served["decode_states"][n])
    np.testing.assert_array_equal(conv, decoded_conv)  # the window shifted by n, to the bit
    assert_within_twice_the_decodes_error(
        recurrent, decoded_recurrent, served["truth_states"][n], f"recurrent state after {n} drafts"
    )
    if n:  # the outputs of the n drafts it kept
        outs = served["verify_outs"][n][:n]
        assert_within_twice_the_decodes_error(
            outs, served["decode_outs"][:n], served["truth_outs"][:n], f"outputs of the first {n} drafts"
        )


def test_every_draft_gets_the_output_of_its_decode(served: dict) -> None:
    for request, outs in enumerate(served["verify_outs"]):
        assert_within_twice_the_decodes_error(
            outs, served["decode_outs"][:DRAFTS], served["truth_outs"][:DRAFTS], f"request {request}'s drafts"
        )


def test_a_decode_after_the_accept_continues_as_the_sequential_decodes(served: dict) -> None:
    """Slot n decodes token n after keeping n drafts: the sequential run's (n + 1)-th decode (vLLM
    #40738: the next step reads the state after the last accepted token and the conv shifted by n)."""
    assert_within_twice_the_decodes_error(
        served["decoded_on"], served["decode_outs"], served["truth_outs"], "the decode after the accept"
    )
