"""`python -m benchmarks.spread_power` judges the search's first cases and counts what each check catches."""

from __future__ import annotations

import pytest

from benchmarks import spread_power


def test_spread_power_counts_the_cases_it_judges(capsys: pytest.CaptureFixture) -> None:
    assert spread_power.main(["--cases", "3", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    counts = {
        line.rsplit("  ", 1)[0].strip(): line.rsplit("  ", 1)[1].strip()
        for line in out.splitlines()
        if line.startswith(("cases", "the implementation", "defect"))
    }
    cases = int(counts["cases"])
    assert 1 <= cases <= 3
    assert counts["the implementation fails layer-state, before / after"].endswith("/ 0")
    assert counts["the implementation fails layer-kernel-state (worst ratio)"].startswith("0 (")
    assert counts["defect caught before, by neither after"] == "0"
