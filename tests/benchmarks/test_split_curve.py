"""`python -m benchmarks.split_curve` runs and writes its table (mini preset, a few tokens, kda_impl)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import split_curve


def test_split_curve_writes_its_table(tmp_path: Path) -> None:
    argv = ["--preset", "mini", "--tokens", "6", "--pieces", "2", "--dtype", "bf16"]
    assert split_curve.main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    table = (tmp_path / split_curve.TABLE_FILE).read_text().splitlines()
    rows = {line.split(" | ")[1]: line.split(" | ") for line in table if line.startswith("| kda_impl |")}
    assert set(rows) == {"unsplit", "2"}, table
    assert rows["unsplit"][2] == "1" and rows["2"][2] == "3"  # calls
    assert rows["unsplit"][5] == "0" and rows["unsplit"][8] == "yes"  # the unsplit run against itself
    assert all(0 < float(row[3]) < 2e-2 for row in rows.values())  # out vs the truth: bf16's error


def test_an_option_no_implementation_has_is_refused(tmp_path: Path) -> None:
    argv = [
        "--preset",
        "mini",
        "--tokens",
        "6",
        "--pieces",
        "2",
        "--impl-option",
        "sglangjax=/x",
        "--out",
        str(tmp_path),
    ]
    with pytest.raises(ValueError, match=r"--impl-option \['sglangjax'\]: no --impl \['kda_impl'\]"):
        split_curve.main(argv)
