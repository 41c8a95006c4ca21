"""A check decided: its measurement against the reference, its attribution against the float64 truth
and its precision-contract check where it has them, and the `Verdict` their criteria give under the
check's gate mode (`conformance.judging.verdict.decide`)."""

from __future__ import annotations

import dataclasses
import math

from conformance.judging.attribution import Attribution
from conformance.judging.contract import ContractCheck
from conformance.judging.matmul_diagnosis import MatmulDiagnosis
from conformance.judging.measurement import Measurement
from conformance.judging.verdict import CONTRACT_MODE, Criterion, Verdict, decide


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A check decided by the gate `mode` of its policy (`verdict`).

    attribution: both sides against the float64 truth, or None with `no_truth` saying why; contract: the
    implementation against the bf16 precision contract's model where the mode asks for it, or None with
    `no_contract` saying why. Without a truth the absolute gate decides; without a model of the contract,
    the relative gate alone (`verdict.judged_by`). matmul_diagnosis: a failing fp32 result that matches
    a reduced-precision matmul (a named cause, never a verdict).
    """

    measurement: Measurement
    mode: str
    verdict: Verdict
    attribution: Attribution | None = None
    no_truth: str | None = None
    contract: ContractCheck | None = None
    no_contract: str | None = None
    matmul_diagnosis: MatmulDiagnosis | None = None

    @property
    def usable(self) -> bool:
        return self.measurement.usable

    @property
    def passed(self) -> bool:
        return self.usable and self.verdict.passed

    @property
    def failures(self) -> list[str]:
        """What decides against the check."""
        return self.verdict.failures() if self.usable else [self.measurement.unusable]

    @property
    def absolute_failures(self) -> list[str]:
        """What the absolute limits say, whether they decide or not."""
        return self.verdict.failures("finite", "absolute") if self.usable else [self.measurement.unusable]

    @property
    def judged_by(self) -> str:
        return self.verdict.judged_by

    @property
    def gate_ratio(self) -> float:
        """The largest criterion of the deciding gate(s) as a share of its limit: <= 1 holds."""
        return self.verdict.ratio() if self.usable else math.nan

    @property
    def absolute_ratio(self) -> float:
        """The largest of the absolute gate's criteria as a share of its limit: <= 1 holds."""
        return self.verdict.ratio("finite", "absolute") if self.usable else math.nan

    @property
    def blame(self) -> str:
        """Who the difference comes from (`attribution.BLAMES`), or `n/a` without a truth."""
        return "n/a" if self.attribution is None else self.attribution.blame


def judge(
    measured: Measurement,
    mode: str,
    attribution: Attribution | None = None,
    no_truth: str | None = None,
    contract: ContractCheck | None = None,
    no_contract: str | None = None,
    relative: tuple[Criterion, ...] | None = None,
) -> Comparison:
    """`measured` decided by the gate `mode` (`verdict.MODE_GATES`): its own criteria, the relative
    gate's where there is a truth (`attribution`, or None with `no_truth` saying why; `relative` in place
    of the attribution's own criteria) and the precision contract's where there is its model
    (`contract`, or None with `no_contract` saying why)."""
    if attribution is None and no_truth is None:
        no_truth = "not looked up" if measured.usable else "nothing compared"
    if contract is None and no_contract is None:
        no_contract = "not looked up" if mode == CONTRACT_MODE else f"gate mode {mode!r} has no contract"
    criteria = measured.criteria
    if measured.usable and attribution is not None:
        criteria += attribution.criteria if relative is None else relative
    if measured.usable and contract is not None:
        criteria += contract.criteria
    return Comparison(measured, mode, decide(mode, criteria), attribution, no_truth, contract, no_contract)
