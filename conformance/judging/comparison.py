"""A check decided: its measurement with the criteria of its gate mode (absolute, the relative gate's
where there is a truth, the precision contract's where there is its model), decided by the verdict
engine (`conformance.judging.verdict.decide`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance.judging.attribution import (
    Attribution,
)
from conformance.judging.contract import ContractCheck
from conformance.judging.matmul_diagnosis import MatmulDiagnosis
from conformance.judging.measurement import (
    Measurement,
    measure,
)
from conformance.judging.tolerances import CONTRACT_MODE, Tolerance
from conformance.judging.verdict import Criterion, Verdict, decide, worst_ratio


@dataclasses.dataclass(frozen=True)
class Comparison(Measurement):
    """A measurement decided: its criteria, by the gate `mode` of the check's policy (`decision`).

    attribution: both sides against the float64 truth, or None with `no_truth` saying why; contract: the
    implementation against the bf16 precision contract's model where the mode asks for it, or None with
    `no_contract` saying why. Without a truth the absolute gate decides; without a model of the contract,
    the relative gate alone (`verdict.judged_by`).
    """

    mode: str = "absolute"
    attribution: Attribution | None = None
    no_truth: str | None = "not looked up"
    contract: ContractCheck | None = None
    no_contract: str | None = "not looked up"
    decision: Verdict = dataclasses.field(default_factory=lambda: Verdict("absolute", ()))
    matmul_diagnosis: MatmulDiagnosis | None = None  # a failing fp32 result that matches a reduced matmul

    @property
    def passed(self) -> bool:
        return self.usable and self.decision.passed

    @property
    def failures(self) -> list[str]:
        """What decides against the check."""
        return [self.unusable] if not self.usable else self.decision.failures()

    @property
    def absolute_failures(self) -> list[str]:
        """What the absolute limits say, whether they decide or not."""
        if not self.usable:
            return [self.unusable]
        return self.decision.failures("finite") + self.decision.failures("absolute")

    @property
    def judged_by(self) -> str:
        return self.decision.judged_by

    @property
    def absolute_ratio(self) -> float:
        """The largest of the absolute gate's criteria as a share of its limit: <= 1 holds."""
        return worst_ratio(self.absolute_criteria) if self.usable else math.nan

    @property
    def gate_ratio(self) -> float:
        """The largest criterion of the deciding gate(s) as a share of its limit: <= 1 holds."""
        return self.decision.ratio if self.usable else math.nan

    @property
    def verdict(self) -> str:
        """Who the difference comes from (`VERDICTS`), or `n/a` without a truth."""
        return "n/a" if self.attribution is None else self.attribution.verdict

    def summary(self) -> str:
        """One line: what failed (or the margin when it holds), where, and by how much."""
        if self.passed:
            note = " (not gated: too few tokens)" if self.tolerance.max_nrmse and not self.nrmse_gated else ""
            text = f"holds: margin {self.margin:.3g}, nrmse {self.nrmse:.3g}{note}"
            if self.judged_by != "absolute":
                text += f"; {self.judged_by} gate ratio {self.gate_ratio:.3g}"
        else:
            text = "; ".join(self.failures)
        if self.attribution is not None:
            a = self.attribution
            text += (
                f" [vs truth: impl margin {a.impl.margin:.3g}, reference {a.reference.margin:.3g}; "
                f"verdict {a.verdict}]"
            )
        if self.matmul_diagnosis is not None:
            text += f"; likely cause: {self.matmul_diagnosis.text()}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "n_outside": self.n_outside,
            "share_outside": self.share_outside,
            "margin": self.margin,
            "nrmse": self.nrmse,
            "nrmse_gated": self.nrmse_gated,
            "gated_nrmse": self.gated_nrmse,
            "gate_ratio": self.gate_ratio,
            "nonfinite": self.nonfinite,
            "worst": self.worst,
            "tolerance": self.tolerance.as_dict(),
            "rfc": self.rfc,
            "passed": self.passed,
            "failures": self.failures,
            "mode": self.mode,
            "judged_by": self.judged_by,
            "criteria": [criterion.as_dict() for criterion in self.decision.criteria],
            "absolute_ratio": self.absolute_ratio,
            "absolute_failures": self.absolute_failures,
            "truth": (
                self.attribution.as_dict()
                if self.attribution is not None
                else {"available": False, "reason": self.no_truth}
            ),
            "contract": (
                self.contract.as_dict()
                if self.contract is not None
                else {"available": False, "reason": self.no_contract}
            ),
            "matmul_diagnosis": None if self.matmul_diagnosis is None else self.matmul_diagnosis.as_dict(),
        }


def judge(
    measured: Measurement,
    mode: str,
    attribution: Attribution | None,
    no_truth: str | None = None,
    contract: ContractCheck | None = None,
    no_contract: str | None = None,
    relative: tuple[Criterion, ...] | None = None,
) -> Comparison:
    """`measured` decided by the gate `mode` (`verdict.MODE_GATES`): its absolute criteria, the
    relative gate's where there is a truth (`attribution`, or None with `no_truth` saying why; `relative`
    in place of the attribution's own criteria) and the precision contract's where there is its model
    (`contract`, or None with `no_contract` saying why)."""
    if contract is None and no_contract is None:
        no_contract = "not looked up" if mode == CONTRACT_MODE else f"gate mode {mode!r} has no contract"
    criteria: tuple[Criterion, ...] = ()
    if measured.usable:
        criteria = (measured.finite_criterion, *measured.absolute_criteria)
        if attribution is not None:
            criteria += attribution.relative_criteria if relative is None else relative
        if contract is not None:
            criteria += contract.criteria
    fields = {field.name: getattr(measured, field.name) for field in dataclasses.fields(Measurement)}
    return Comparison(
        **fields,
        mode=mode,
        attribution=attribution,
        no_truth=no_truth,
        contract=contract,
        no_contract=no_contract,
        decision=decide(mode, criteria),
    )


def compare(
    actual: np.ndarray,
    expected: np.ndarray,
    tolerance: Tolerance,
    rfc_tolerance: Tolerance,
    axes: tuple[str, ...] = (),
    positions: dict[str, np.ndarray] | None = None,
    seq_lens: Sequence[int] | None = None,
    min_tokens: int = 0,
) -> Comparison:
    """`measure` decided by the absolute gate alone (no truth looked up)."""
    measured = measure(actual, expected, tolerance, rfc_tolerance, axes, positions, seq_lens, min_tokens)
    return judge(measured, "absolute", None, "not looked up")
