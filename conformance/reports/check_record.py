"""A decided check as report.json records it (`metrics`), read back (`criterion_from_record`: the gate
decides again from what a report records), and in one line (`summary`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from conformance.judging.attribution import Attribution
from conformance.judging.comparison import Comparison
from conformance.judging.contract import ContractCheck
from conformance.judging.matmul_diagnosis import MatmulDiagnosis
from conformance.judging.verdict import Criterion, unmet, worst_ratio
from conformance.reports.json_file import number_from_json

_NUMBER_FIELDS = ("value", "factor", "reference", "floor")


def metrics(c: Comparison) -> dict[str, Any]:
    """A check's `metrics` in report.json: its numbers against the reference, its criteria and verdict,
    its truth and contract blocks."""
    m = c.measurement
    return {
        "shape": list(m.shape),
        "max_abs": m.max_abs,
        "max_rel": m.max_rel,
        "n_outside": m.n_outside,
        "share_outside": m.share_outside,
        "margin": m.margin,
        "nrmse": m.nrmse,
        "nrmse_gated": m.nrmse_gated,
        "gated_nrmse": m.gated_nrmse,
        "gate_ratio": c.gate_ratio,
        "nonfinite": m.nonfinite,
        "worst": m.worst,
        "tolerance": m.tolerance.as_dict(),
        "rfc": m.rfc,
        "passed": c.passed,
        "failures": c.failures,
        "mode": c.mode,
        "judged_by": c.judged_by,
        "criteria": [criterion_record(criterion) for criterion in c.verdict.criteria],
        "absolute_ratio": c.absolute_ratio,
        "absolute_failures": c.absolute_failures,
        "truth": (
            truth_record(c.attribution)
            if c.attribution is not None
            else {"available": False, "reason": c.no_truth}
        ),
        "contract": (
            contract_record(c.contract)
            if c.contract is not None
            else {"available": False, "reason": c.no_contract}
        ),
        "matmul_diagnosis": None if c.matmul_diagnosis is None else diagnosis_record(c.matmul_diagnosis),
    }


def _sides_record(judged: Attribution | ContractCheck) -> dict[str, Any]:
    """What the truth record and the contract record share: both sides measured against one source."""
    return {
        "available": True,
        "source": judged.source,
        "impl": dataclasses.asdict(judged.impl),
        "reference": dataclasses.asdict(judged.reference),
        "limits": judged.limits.as_dict(),
    }


def truth_record(a: Attribution) -> dict[str, Any]:
    return {
        **_sides_record(a),
        "apart": a.out_of_tolerance,
        "verdict": a.blame,
        "relative_ratio": worst_ratio(a.criteria),
        "relative_failures": unmet(a.criteria),
    }


def contract_record(c: ContractCheck) -> dict[str, Any]:
    return {
        **_sides_record(c),
        "fp32_stage": c.fp32_stage,
        **c.gating.criterion_fields(),
        "gated": c.gating.applies,
        "truth_nrmse": {"impl": c.impl_truth_nrmse, "model": c.model_truth_nrmse},
        "closer": c.closer,
        "spread": None if c.spread is None else dataclasses.asdict(c.spread),
        "max_nrmse": c.max_nrmse,
        "ratio": worst_ratio(c.criteria),
        "failures": unmet(c.criteria),
    }


def diagnosis_record(d: MatmulDiagnosis) -> dict[str, Any]:
    return {
        "model": d.model.name,
        "means": d.model.means,
        "fix": d.model.fix,
        "nrmse_vs_model": d.nrmse_vs_model,
        "nrmse_vs_truth": d.nrmse_vs_truth,
        "text": d.text(),
    }


def criterion_record(c: Criterion) -> dict[str, Any]:
    """A criterion as a report records it: its numbers, and what they decide (derived, never read)."""
    record = {
        "gate": c.gate,
        "statistic": c.statistic,
        "value": c.value,
        "factor": c.factor,
        "reference": c.reference,
        "floor": c.floor,
        "bound": c.bound,
        "tokens": c.tokens,
        "min_tokens": c.min_tokens,
        "applies": c.applies,
        "holds": c.holds,
    }
    if c.detail:
        record["detail"] = c.detail
    if c.floor_source:
        record["floor_source"] = c.floor_source
    if c.reference_source:
        record["reference_source"] = c.reference_source
    if not c.applies:
        record["not_applied"] = c.why_not_applied()
    if c.unless is not None:
        record["unless"] = criterion_record(c.unless)
    return record


def criterion_from_record(record: Mapping[str, Any], label: str) -> Criterion:
    """The criterion a report records (its derived fields — bound, applies, holds, not_applied —
    recomputed, never read); a ValueError names the field at fault."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{label}: a criterion must be an object, found {record!r}")
    numbers = {name: _number(record, name, label) for name in _NUMBER_FIELDS}
    counts = {name: _count(record, name, label) for name in ("tokens", "min_tokens")}
    texts = {
        name: record.get(name, "")
        for name in ("gate", "statistic", "detail", "floor_source", "reference_source")
    }
    for name, text in texts.items():
        if not isinstance(text, str):
            raise ValueError(f"{label}: criterion {name!r} must be a string, found {text!r}")
    unless = record.get("unless")
    try:
        return Criterion(
            **texts,
            **numbers,
            **counts,
            unless=None if unless is None else criterion_from_record(unless, f"{label}: unless"),
        )
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None


def _number(record: Mapping[str, Any], name: str, label: str) -> float:
    """A recorded number (`number_from_json`)."""
    value = number_from_json(record.get(name))
    if value is None:
        raise ValueError(f"{label}: criterion {name!r} must be a number, found {record.get(name)!r}")
    return value


def _count(record: Mapping[str, Any], name: str, label: str) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{label}: criterion {name!r} must be a whole number >= 0, found {value!r}")
    return value


def summary(c: Comparison) -> str:
    """One line: what failed (or the margin when it holds), where, and by how much."""
    m = c.measurement
    if c.passed:
        note = " (not gated: too few tokens)" if m.tolerance.max_nrmse and not m.nrmse_gated else ""
        text = f"holds: margin {m.margin:.3g}, nrmse {m.nrmse:.3g}{note}"
        if c.judged_by != "absolute":
            text += f"; {c.judged_by} gate ratio {c.gate_ratio:.3g}"
    else:
        text = "; ".join(c.failures)
    if c.attribution is not None:
        a = c.attribution
        text += (
            f" [vs truth: impl margin {a.impl.margin:.3g}, reference {a.reference.margin:.3g}; "
            f"verdict {a.blame}]"
        )
    if c.matmul_diagnosis is not None:
        text += f"; likely cause: {c.matmul_diagnosis.text()}"
    return text
