"""The table of check kinds: every kind is computed somewhere, every name reads back as its check."""

from __future__ import annotations

import pytest

from conformance.checks import kinds
from conformance.checks.catalogue import CheckSpec, case_checks, long_case_checks
from conformance.checks.kinds import Check, parse_check
from conformance.checks.runner import _SIDES
from conformance.checks.serving_checks import _RESULTS
from conformance.checks.serving_scenarios import Scenario
from conformance.dumps.reader import CaseInfo


def test_every_kind_has_the_function_that_computes_it() -> None:
    computed = {*_SIDES, *_RESULTS, *kinds.BY_POSITION_KINDS}
    assert set(kinds.KINDS) == computed
    assert set(_RESULTS) == set(kinds.SERVING_KINDS)


@pytest.mark.parametrize(
    "check",
    [
        *case_checks((5, 17, 1, 41)),
        *long_case_checks(CaseInfo("long", "", "", (1024,), False, "chunk", (), decode_steps=8)),
        *(Check(kind, "mixed-extend") for kind in kinds.SERVING_KINDS),
        *(Check(kind, "a-b-c") for kind in kinds.SERVING_KINDS),
    ],
    ids=lambda check: check.name,
)
def test_a_name_reads_back_as_its_check(check: Check) -> None:
    assert parse_check(check.name) == check
    assert CheckSpec("T1", "fp32", check.name).of == check


def test_a_scenario_whose_checks_would_read_as_another_ones_is_refused() -> None:
    with pytest.raises(ValueError, match="must not end in '-state'"):
        Scenario("a-state", 2, ())


def test_a_decode_check_knows_its_steps() -> None:
    assert Check(kinds.DECODE_SELF, "k8").decode_steps == 8
    assert Check(kinds.DECODE, "all").decode_steps is None


@pytest.mark.parametrize("name", ["decode-k", "kernel-chunky", "q_after_conv-state", "serving-", ""])
def test_an_unknown_name_is_refused_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match="no check is named"):
        parse_check(name)


def test_a_kind_refuses_the_wrong_argument() -> None:
    with pytest.raises(ValueError, match="takes an argument"):
        Check(kinds.DECODE)
    with pytest.raises(ValueError, match="takes no argument"):
        Check(kinds.LAYER, "k1")


def test_the_summary_columns_are_the_kinds_groups_in_order() -> None:
    assert kinds.GROUPS == ("layer", "kernel", "training", "intermediate", "decode", "chunked", "serving")
