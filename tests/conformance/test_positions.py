"""The long cases' error by position (conformance/judging/positions.py): windows, the per-window relative
gate, and the files beside report.md, on a small long-ish set (T = 1024, windows of 256 tokens)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conformance.checks import truth
from conformance.checks.catalogue import CheckSpec, plan
from conformance.checks.runner import CheckRunner
from conformance.checks.truth import COMPUTED_LAYER_TRUTH_SOURCE
from conformance.cli import main
from conformance.dumps.reader import DumpError, DumpSet
from conformance.judging.limits import RelativeLimits, Tolerance
from conformance.judging.positions import position_profile, window_bounds
from conformance.policy import TolerancePolicy
from kda_spec import dump_format as fmt
from tests.conformance.numpy_adapter import NumpyAdapter
from tests.conformance.synthetic import write_dump_set

NUMPY = "tests.conformance.numpy_adapter:NumpyAdapter"
DRIFT_FROM = 768  # the drifting adapter's output leaves the reference from this token on


def long_set(root: Path, truth: bool) -> Path:
    """T1024 (with its float64 truth where `truth`), listed twice as a long case: a prefill, and a prefill
    of 768 tokens then 256 decode steps (the manifest fields dump_gen writes for the `long` group)."""
    root = write_dump_set(root, ("T1024",), truth=truth, intermediates=False)
    manifest = json.loads((root / "manifest.json").read_text())
    prefill = {**manifest["cases"][0], "id": "long_T1024", "group": "long"}
    decode = {**prefill, "id": "long_prefill768_decode256", "decode_steps": 256}
    manifest["cases"] = [prefill, decode]
    for case in manifest["cases"]:  # a case lives in cases/<id>.npz
        case["file"] = fmt.case_file(case["id"])
        shutil.copyfile(root / fmt.case_file("T1024"), root / case["file"])
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def long_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return long_set(tmp_path_factory.mktemp("long"), truth=True)


class LateDrift(NumpyAdapter):
    """The numpy reference with an error that grows along the sequence from token 768 on: a prefill's
    rows scaled by 1 + 1e-4 · (t - 767), every decoded row by 1 + 1e-3."""

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        result = super().layer_extend(hidden_states, cu_seqlens, initial_state, carry)
        tokens = np.arange(result.out.shape[0])
        drift = (1 + 1e-4 * np.maximum(tokens - DRIFT_FROM + 1, 0)).astype(np.float32)
        result.out = result.out * drift[:, None]
        return result

    def layer_decode(self, hidden_states, carry):
        result = super().layer_decode(hidden_states, carry)
        result.out = result.out * np.float32(1 + 1e-3)
        return result


def test_windows_cover_the_tokens_in_order() -> None:
    assert window_bounds(1024, 256) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert window_bounds(1000, 256)[-1] == (768, 1000)
    with pytest.raises(ValueError, match="window_tokens"):
        window_bounds(10, 0)


def test_profile_measures_each_window_against_the_truth() -> None:
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(1000, 8))
    growth = np.repeat(np.arange(1, 5), 256)[:1000, None]  # window w's error scales with w + 1
    impl = truth + 1e-6 * growth * rng.normal(size=truth.shape)
    reference = truth + 1e-6 * rng.normal(size=truth.shape)
    tolerance, limits = Tolerance(1e-5, 1e-5), RelativeLimits(2.0, 0.5, 2e-7)
    profile = position_profile(
        impl, reference, truth, tolerance, limits, case_id="c", dtype="fp32", check="layer-positions"
    )
    assert [(w.start, w.end) for w in profile.windows] == window_bounds(1000, 256)
    for window in profile.windows:
        rows = slice(window.start, window.end)
        error = impl[rows] - truth[rows]
        assert window.attribution.impl.max_abs == pytest.approx(np.abs(error).max(), rel=1e-12)
        assert window.impl_rms == pytest.approx(np.sqrt(np.mean(error**2)), rel=1e-12)
        ref_error = reference[rows] - truth[rows]
        assert window.reference_rms == pytest.approx(np.sqrt(np.mean(ref_error**2)), rel=1e-12)
        margin = np.max(np.abs(error) / (1e-5 + 1e-5 * np.abs(truth[rows])))
        assert window.attribution.impl.margin == pytest.approx(margin, rel=1e-12)
    rms = [w.impl_rms for w in profile.windows]
    assert rms == sorted(rms) and rms[-1] > 3 * rms[0]
    with pytest.raises(ValueError, match="one shape"):
        position_profile(impl[:10], reference, truth, tolerance, limits, case_id="c", dtype="fp32", check="x")


def test_long_cases_get_their_own_checks(long_dumps: Path) -> None:
    checks = {(s.case_id, s.check) for s in plan(DumpSet(str(long_dumps)), ["long_T1024"], ["fp32"])}
    assert checks == {("long_T1024", c) for c in ("layer", "layer-state", "layer-positions")}
    specs = plan(DumpSet(str(long_dumps)), ["long_prefill768_decode256"], ["bf16"])
    assert [s.check for s in specs] == ["decode-k256", "decode-positions"]


@pytest.mark.parametrize("case_id", ["long_T1024", "long_prefill768_decode256"])
def test_late_drift_fails_only_the_windows_it_reaches(long_dumps: Path, case_id: str) -> None:
    runner = CheckRunner(DumpSet(str(long_dumps)), LateDrift, "auto", TolerancePolicy.load())
    check = "decode-positions" if "decode" in case_id else "layer-positions"
    spec = CheckSpec(case_id, "fp32", check)
    comparison = runner.run(spec).comparison
    profile = runner.position_profiles[spec.id]
    assert [w.passed for w in profile.windows] == [True, True, True, False]
    assert profile.decode_from == (768 if "decode" in case_id else None)
    assert not comparison.passed and comparison.judged_by == "relative"
    assert "1 of 4 windows of 256 tokens over the relative gate (tokens 768-1024)" in comparison.failures[0]
    assert comparison.attribution.blame == "impl"
    late, early = profile.windows[-1], profile.windows[0]
    # Before the drift the implementation is the reference itself: the same error, to the rounding of a
    # matmul over 768 rows instead of 1024 (numpy's OpenBLAS blocks them by CPU).
    assert late.impl_rms > 100 * late.reference_rms
    assert early.impl_rms == pytest.approx(early.reference_rms, rel=1e-3)

    faithful = CheckRunner(DumpSet(str(long_dumps)), NumpyAdapter, "auto", TolerancePolicy.load())
    assert faithful.run(spec).comparison.passed


def test_a_long_set_without_truth_is_judged_by_position_against_the_computed_truth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long case whose set stores no truth: the checker computes the output's truth 1024 tokens at a
    time (here over a bound lowered to 512 tokens, so that T1024 takes that path), and the drift fails
    the same windows as against the stored truth."""
    monkeypatch.setattr(truth, "COMPUTE_MAX_TOKENS", 512)
    runner = CheckRunner(
        DumpSet(str(long_set(tmp_path, truth=False))), LateDrift, "auto", TolerancePolicy.load()
    )
    spec = CheckSpec("long_T1024", "fp32", "layer-positions")
    comparison = runner.run(spec).comparison
    assert [w.passed for w in runner.position_profiles[spec.id].windows] == [True, True, True, False]
    assert comparison.attribution.source.startswith(COMPUTED_LAYER_TRUTH_SOURCE)


def test_run_writes_the_curves_beside_the_report(long_dumps: Path, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    assert main(["run", "--dumps", str(long_dumps), "--impl", NUMPY, "--report-dir", str(reports)]) == 0
    assert (reports / "positions.png").read_bytes().startswith(b"\x89PNG")
    with (reports / "positions.csv").open() as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 2 * 2 * 4  # two cases, two dtypes, four windows
    decode_rows = [r for r in rows if r["case"] == "long_prefill768_decode256" and r["dtype"] == "fp32"]
    assert [r["phase"] for r in decode_rows] == ["prefill"] * 3 + ["decode"]
    profiles = json.loads((reports / "positions.json").read_text())["profiles"]
    cases = ("long_T1024", "long_prefill768_decode256")
    expected = {(case, dtype, True) for case in cases for dtype in ("fp32", "bf16")}
    assert {(p["case"], p["dtype"], p["passed"]) for p in profiles} == expected
    report_md = (reports / "report.md").read_text()
    assert "## Error by position (long cases)" in report_md and "](positions.png)" in report_md
    assert main(["gate", str(reports / "report.json")]) == 0


@pytest.mark.parametrize(
    ("field", "value"), [("decode_steps", 1024), ("decode_steps", -1), ("decode_steps", "8"), ("group", 3)]
)
def test_reader_refuses_bad_group_fields(long_dumps: Path, tmp_path: Path, field: str, value: object) -> None:
    manifest = json.loads((long_dumps / "manifest.json").read_text())
    manifest["cases"][1][field] = value
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match=rf"cases\[1\]: '{field}' must be"):
        DumpSet(str(tmp_path))
