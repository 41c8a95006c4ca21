"""Batch invariance of the serving path, a property measured and reported, not a gate: is a running
request's output bit-identical whether or not a prefill joins its batch?

Two schedules of the same running requests on the implementation's pool: each step of theirs alone
(DECODE batches), and the same steps as EXTEND batches with a new request's prefill packed among them.
Both are correct within every gate (the serving checks judge each against the request alone); whether
they are equal to the bit is what an engine's batch invariance (deterministic outputs whatever the
batch) asks, and KDA's part of it is this measurement.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conformance.checks.serving_checks import ServingChecks
from conformance.checks.serving_events import alloc, decode, extend
from conformance.checks.serving_scenarios import Scenario

RUNNING = ("r", "z")  # the running requests
PREFILL = 37  # the tokens of the prefill that joins their batch


@dataclasses.dataclass(frozen=True)
class BatchInvariance:
    """The running requests' outputs of the steps a prefill joined against those of their steps
    alone: how many tokens, how many of them equal to the bit, the largest absolute difference."""

    tokens: int
    identical: int
    max_abs: float

    @property
    def bit_identical(self) -> bool:
        return self.identical == self.tokens

    def describe(self) -> str:
        verdict = "bit-identical" if self.bit_identical else "not bit-identical"
        return (
            f"batch invariance: {verdict} ({self.identical} of {self.tokens} running tokens equal to the bit "
            f"with a {PREFILL}-token prefill in their batch; max |difference| {self.max_abs:.3g})"
        )


def invariance_scenarios(slots: int) -> tuple[Scenario, Scenario]:
    """(the running requests' steps alone, the same steps with a prefill joining them)."""
    start = [*alloc(*RUNNING, "p"), extend(("r", 9), ("z", 5))]
    alone = [*start, decode(*RUNNING), decode(*RUNNING)]
    joined = [*start, extend(("r", 1), ("p", PREFILL), ("z", 1)), extend(("r", 1), ("z", 1), ("p", 1))]
    return Scenario("invariance-alone", slots, tuple(alone)), Scenario(
        "invariance-joined", slots, tuple(joined)
    )


def batch_invariance(checks: ServingChecks, dtype: str) -> BatchInvariance:
    """The measurement on `checks`' adapter in `dtype` (the scenarios must be among `checks`' own)."""
    alone, joined = (checks.run_of(checks.scenarios[name], dtype) for name in
                     ("invariance-alone", "invariance-joined"))  # fmt: skip
    steps = [(alone.outputs[name][-2:], joined.outputs[name][-2:]) for name in RUNNING]
    a, b = (np.concatenate(side) for side in zip(*steps))
    equal = np.all(a.view(np.uint32) == b.view(np.uint32), axis=-1)
    return BatchInvariance(int(equal.size), int(equal.sum()), float(np.max(np.abs(a - b))))
