"""The verdict engine: criteria, the gates a mode decides by, and the round trip through a report."""

from __future__ import annotations

import math

import pytest

from conformance.judging.verdict import Criterion, decide, judged_by
from conformance.reports.check_record import criterion_from_record, criterion_record

MARGIN = Criterion("absolute", "margin", 0.4, 1.0)
NAN_FREE = Criterion("finite", "NaN/Inf values in the result", 0, 0.0)
RELATIVE = Criterion("relative", "margin vs truth", 1.2, 0.5, 2.0, 0.5)  # bound 2×0.5 + 0.5 = 1.5
CLOSER = Criterion("contract", "2× closer to the truth than the model", 1e-3, 0.0, 1.0, 4e-4)
CONTRACT = Criterion(
    "contract", "nRMSE vs the contract's model", 3e-3, 2e-3, tokens=97, min_tokens=32, unless=CLOSER
)


def test_a_bound_is_a_limit_or_a_multiple_of_the_reference_plus_a_floor() -> None:
    assert MARGIN.bound == 1.0 and MARGIN.holds and MARGIN.ratio == pytest.approx(0.4)
    assert RELATIVE.bound == pytest.approx(1.5) and RELATIVE.holds
    assert RELATIVE.statement() == "margin vs truth 1.2 > 2×0.5 + 0.5"
    assert not Criterion("absolute", "margin", math.nan, 1.0).holds  # NaN never holds
    assert Criterion("finite", "NaN/Inf", 2, 0.0).ratio == math.inf


def test_a_criterion_applies_from_its_tokens_and_not_where_its_exemption_holds() -> None:
    assert CONTRACT.applies and not CONTRACT.holds  # 1e-3 > 1 × 4e-4: not closer, so gated
    few = Criterion("contract", "nRMSE", 3e-3, 2e-3, tokens=8, min_tokens=32)
    assert not few.applies and few.holds and few.ratio == 0 and "8 tokens < 32" in few.why_not_applied()
    exempt = Criterion(
        **{**CONTRACT.__dict__, "unless": Criterion("contract", "closer", 1e-4, 0.0, 1.0, 4e-4)}
    )
    assert not exempt.applies and exempt.holds and exempt.why_not_applied().startswith("exempt: closer")
    assert criterion_record(few)[
        "not_applied"
    ] == "not gated: 8 tokens < 32" and "not_applied" not in criterion_record(CONTRACT)


@pytest.mark.parametrize(
    ("mode", "gates", "expected"),
    [
        ("absolute+relative", {"finite", "absolute", "relative"}, "absolute+relative"),
        ("absolute+relative", {"finite", "absolute"}, "absolute"),  # no truth
        ("relative", {"finite", "absolute"}, "absolute"),  # no truth: the absolute gate decides
        ("relative+contract", {"finite", "absolute", "relative"}, "relative"),  # no model of the contract
        ("relative+contract", {"finite", "absolute", "relative", "contract"}, "relative+contract"),
        ("relative", set(), "absolute"),  # nothing measured
    ],
)
def test_the_gates_that_decide_are_the_modes_less_those_without_criteria(mode, gates, expected) -> None:
    criteria = [Criterion(gate, "x", 0, 1.0) for gate in gates]
    assert judged_by(mode, criteria) == expected


def test_a_check_holds_when_every_deciding_criterion_does() -> None:
    failing_absolute = Criterion("absolute", "margin", 3.0, 1.0)
    relative = decide("relative", [NAN_FREE, failing_absolute, RELATIVE])
    assert relative.passed and relative.ratio() == pytest.approx(0.8)  # the absolute margin is reported only
    assert decide("absolute+relative", [NAN_FREE, failing_absolute, RELATIVE]).failures() == ["margin 3 > 1"]
    contract = decide("relative+contract", [NAN_FREE, MARGIN, RELATIVE, CONTRACT])
    assert contract.failures() == ["precision contract: nRMSE vs the contract's model 0.003 > 0.002"]
    with_nan = decide(
        "relative", [Criterion("finite", "NaN/Inf", 1, 0.0, detail="1 NaN/Inf value(s)"), RELATIVE]
    )
    assert with_nan.failures() == ["1 NaN/Inf value(s)"]


def test_a_criterion_round_trips_through_a_report_and_its_derived_fields_are_never_read() -> None:
    record = criterion_record(CONTRACT)
    assert record["holds"] is False and record["unless"]["statistic"] == CLOSER.statistic
    record["holds"], record["applies"], record["bound"] = True, False, 1e9  # recomputed, not read
    rebuilt = criterion_from_record(record, "check")
    assert rebuilt == CONTRACT and not rebuilt.holds


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"floor": math.inf}, "floor must be a finite number >= 0"),
        ({"factor": -1}, "factor must be a finite number >= 0"),
        ({"value": "low"}, "criterion 'value' must be a number"),
        ({"tokens": 1.5}, "criterion 'tokens' must be a whole number >= 0"),
        ({"gate": "lenient"}, "gate must be one of"),
    ],
)
def test_a_malformed_criterion_is_named(edit: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        criterion_from_record({**criterion_record(MARGIN), **edit}, "checks[0]")
