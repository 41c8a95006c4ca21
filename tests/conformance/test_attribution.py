"""Attribution against the float64 truth: the kernel truth's recurrence, reading truth keys, both
sides' errors and the verdict of every check, in report.md / report.json and in `conformance diff`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, CheckSpec, plan
from conformance.checks.kinds import Check
from conformance.checks.runner import CheckRunner
from conformance.checks.truth import COMPUTED_LAYER_TRUTH_SOURCE, recurrence_fp64
from conformance.cli import main
from conformance.dumps.reader import DumpError, DumpSet
from conformance.judging.attribution import Attribution, TruthError
from conformance.judging.limits import RelativeLimits
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import metrics, summary
from conformance.reports.render import markdown, terminal_lines
from conformance.reports.report import Record, build_report
from kda_spec import dump_format as fmt
from kda_spec.truth import packed_delta_rule
from tests.conformance.numpy_adapter import NumpyAdapter
from tests.conformance.synthetic import write_dump_set

CASES = ("T8", "T65", "varlen_initstate")
LIMITS = RelativeLimits(factor=2.0, margin_floor=0.1, nrmse_floor=1e-7)
NUMPY = "tests.conformance.numpy_adapter:NumpyAdapter"
FLIPPED = "tests.conformance.broken_adapters:NumpyFlippedGate"


@pytest.fixture(scope="module")
def truth_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dump_set(tmp_path_factory.mktemp("truth"), CASES, truth=True)


@pytest.fixture(scope="module")
def plain_dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dump_set(tmp_path_factory.mktemp("plain"), CASES)


# ------------------------------------------------------------------------------- the kernel truth


def test_the_kernel_truth_recurrence_is_float64_where_float32_cannot_be() -> None:
    """A decay of exp(-1e-9) per token is 1.0 in float32; over 1000 tokens float64 keeps 1 - 1e-6."""
    tokens, heads, dim = 1000, 1, 2
    zeros = np.zeros((tokens, heads, dim), np.float32)
    g = np.full((tokens, heads, dim), -1e-9, np.float32)
    q = np.zeros_like(zeros)
    q[-1, 0, 0] = 1.0
    initial = np.ones((1, heads, dim, dim), np.float32)
    cu = np.array([0, tokens])
    o, state = recurrence_fp64((q, zeros, zeros, g, np.zeros((tokens, heads), np.float32)), cu, initial)
    assert state.dtype == np.float64 and o.dtype == np.float64
    np.testing.assert_allclose(state[0, 0], np.exp(-1e-6), rtol=1e-12)
    _, state32 = packed_delta_rule(q, zeros, zeros, g, np.zeros((tokens, heads), np.float32), cu, initial)
    assert np.all(state32 == 1.0)  # float32 cannot see this decay at all


def test_the_kernel_truth_agrees_with_the_float32_recurrence_to_rounding() -> None:
    rng = np.random.default_rng(3)
    tokens, heads, dim = 40, 2, 8
    q, k = (rng.normal(size=(tokens, heads, dim)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(tokens, heads, dim)).astype(np.float32)
    g = -rng.uniform(0, 0.5, (tokens, heads, dim)).astype(np.float32)
    beta = rng.uniform(0, 1, (tokens, heads)).astype(np.float32)
    cu = np.array([0, 15, tokens])
    o64, s64 = recurrence_fp64((q, k, v, g, beta), cu, None)
    o32, s32 = packed_delta_rule(q, k, v, g, beta, cu, None)
    np.testing.assert_allclose(o64, o32, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s64, s32, rtol=1e-4, atol=1e-5)
    assert np.abs(o64 - o32).max() > 0  # not the same float32 computation


# ----------------------------------------------------------------------------- reading truth keys


def _rewrite_case(root: Path, case_id: str, change) -> None:
    manifest = json.loads((root / fmt.MANIFEST_FILE).read_text())
    entry = next(e for e in manifest["cases"] if e["id"] == case_id)
    arrays = dict(np.load(root / entry["file"]))
    change(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (root / entry["file"]).write_bytes(buffer.getvalue())
    entry["sha256"], entry["keys"] = fmt.sha256_bytes(buffer.getvalue()), sorted(arrays)
    (root / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))


def test_the_reader_keeps_truth_keys_in_float64(truth_dumps: Path) -> None:
    case = DumpSet(str(truth_dumps)).case("T65")
    for name in fmt.TRUTH_NAMES:
        for dtype in fmt.DTYPES:
            assert case.arrays[fmt.truth_key(name, dtype)].dtype == np.float64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(out_fp64=a["out_fp64"].astype(np.float32)), "'out_fp64': expected dtype float64"),
        (lambda a: a.update(g_bf16_fp64=a["g_bf16_fp64"][:-1]), "'g_bf16_fp64': expected shape"),
    ],
)
def test_a_broken_truth_key_is_a_dump_error_naming_it(tmp_path: Path, change, message: str) -> None:
    root = write_dump_set(tmp_path, ("T8",), truth=True)
    _rewrite_case(root, "T8", change)
    with pytest.raises(DumpError, match=message):
        DumpSet(str(root)).case("T8")


# ------------------------------------------------------------------------------ every check judged


def _runner(root: Path, adapter=NumpyAdapter) -> CheckRunner:
    return CheckRunner(DumpSet(str(root)), adapter, "auto", TolerancePolicy.load())


def _comparisons(root: Path, adapter=NumpyAdapter) -> dict[str, object]:
    runner, found = _runner(root, adapter), {}
    for spec in plan(runner.dumps, list(CASES), ["fp32", "bf16"]):
        try:
            found[spec.id] = runner.run(spec).comparison
        except CheckSkipped:
            continue
    return found


def test_every_check_records_both_sides_against_the_truth(truth_dumps: Path) -> None:
    comparisons = _comparisons(truth_dumps)
    assert len(comparisons) > 100
    bit_exact = {kind.pattern for kind in kinds.KINDS if kind.truth is None}  # causality: no truth applies
    for check_id, c in comparisons.items():
        if check_id.split("-", 2)[2] in bit_exact:
            assert c.attribution is None and c.passed, check_id
            continue
        assert c.attribution is not None, check_id
        assert c.blame == "conditioning", check_id
        if "decode" not in check_id and "chunked" not in check_id:  # one prefill is the reference
            assert c.attribution.impl == c.attribution.reference, check_id
    kernel = comparisons["T65-fp32-kernel-chunk"].attribution
    assert kernel.source == "float64 recurrence on the dumped kernel inputs"
    assert 0 < kernel.impl.margin < 0.1 and 0 < kernel.impl.nrmse < 1e-6
    layer = comparisons["T65-bf16-layer"].attribution
    assert layer.source == "dump: out_bf16_fp64" and layer.impl.nrmse > 1e-3  # bf16's own rounding
    decode = comparisons["T65-fp32-decode-k8"].attribution
    assert decode.source == "dump: out_fp64"  # the decoded rows of the output's truth


def test_the_truth_compares_the_dumped_kernel_inputs_not_the_layer_ones(truth_dumps: Path) -> None:
    """The kernel truth is the recurrence on exactly what the kernel got: the reference kernel's
    own output is as close to it as float32 allows, on every case and dtype."""
    runner = _runner(truth_dumps)
    for case in CASES:
        for dtype in fmt.DTYPES:
            for check in (Check(kind) for kind in kinds.KERNEL_KINDS):
                attribution = runner.run(CheckSpec(case, dtype, check)).comparison.attribution
                assert attribution.reference.margin < 0.2, (case, dtype, check)


def test_a_set_without_truth_is_judged_against_the_truth_computed_here(
    truth_dumps: Path, plain_dumps: Path
) -> None:
    """A set that stores no truth gets the verdicts it would get with one: the checker computes the
    truth from its weights and hidden states, the same numbers as the stored one."""
    plain, stored = _comparisons(plain_dumps), _comparisons(truth_dumps)
    layer = plain["T65-fp32-layer"]
    assert layer.attribution.source == COMPUTED_LAYER_TRUTH_SOURCE
    assert layer.judged_by == "absolute+relative"
    for check_id, comparison in plain.items():
        with_truth = stored[check_id]
        assert (comparison.blame, comparison.passed) == (with_truth.blame, with_truth.passed), check_id
        if with_truth.attribution is None:  # a bit-exact check: no truth on either side
            assert comparison.attribution is None, check_id
            continue
        assert comparison.attribution.impl.nrmse == pytest.approx(with_truth.attribution.impl.nrmse, rel=1e-9)


def test_a_check_without_a_truth_says_why_and_judges_by_the_absolute_gate(
    plain_dumps: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An intermediate of a case longer than the checker computes every result for has no truth."""
    monkeypatch.setattr("conformance.checks.truth.COMPUTE_MAX_TOKENS", 64)
    o_norm = _runner(plain_dumps).run(CheckSpec("T65", "fp32", "o_norm")).comparison
    assert o_norm.attribution is None and o_norm.blame == "n/a" and o_norm.judged_by == "absolute"
    reason = (
        "the truth computed here of a case of 65 tokens (over the 64 the checker computes every result "
        "for) has no 'o_norm': only 'out' and 'recurrent_state'"
    )
    assert metrics(o_norm)["truth"] == {"available": False, "reason": reason}


# ------------------------------------------------------------------------------------ the verdicts


def _attribution(
    impl: tuple[float, float], reference: tuple[float, float], apart: bool = True
) -> Attribution:
    return Attribution(
        "test", TruthError(impl[0], impl[1], 0.0), TruthError(reference[0], reference[1], 0.0), LIMITS, apart
    )


@pytest.mark.parametrize(
    ("impl", "reference", "apart", "verdict"),
    [
        ((5.0, 1e-6), (0.5, 2e-7), True, "impl"),  # impl 10x further on both measures
        ((0.3, 3e-7), (0.3, 3e-6), True, "reference"),  # the reference's nRMSE 10x the impl's
        ((5.0, 1e-7), (0.5, 1e-5), True, "both"),  # each clearly worse on one measure
        ((3.0, 1e-6), (2.5, 1e-6), True, "both"),  # equally far, both outside the tolerance of the truth
        ((0.7, 1e-6), (0.6, 1e-6), True, "conditioning"),  # equally far, within it: the o_norm
        ((3.0, 1e-6), (2.5, 1e-6), False, "conditioning"),  # equally far, and the two sides agree
        ((0.05, 1e-7), (0.001, 1e-9), False, "conditioning"),  # both below the floors
    ],
)
def test_the_verdict(impl, reference, apart: bool, verdict: str) -> None:
    assert _attribution(impl, reference, apart).blame == verdict


# ------------------------------------------------------------------------------------ report, diff


def _report(root: Path, adapter=NumpyAdapter) -> dict:
    runner = _runner(root, adapter)
    records = []
    for spec in plan(runner.dumps, ["T65"], ["fp32", "bf16"]):
        try:
            c = runner.run(spec).comparison
        except CheckSkipped:  # the raw-gate kernel checks: the synthetic sets have no g_raw
            continue
        records.append(Record(spec, "passed" if c.passed else "failed", summary(c), 0.0, c))
    meta = {
        "implementation": {"impl": "numpy", "name": "numpy", "kernel": "auto", "kernel_used": {}},
        "environment": {"backend": "cpu", "device_kind": "cpu", "versions": {}},
        "dumps": {"url": str(root), "manifest": {"config": {}}},
        "tolerances": TolerancePolicy.load().as_dict(),
    }
    return build_report(records, meta, 0.5)


def test_report_json_and_md_carry_the_attribution(truth_dumps: Path, plain_dumps: Path) -> None:
    report = _report(truth_dumps)
    truth = next(c for c in report["checks"] if c["id"] == "T65-fp32-o_norm")["metrics"]["truth"]
    assert truth["available"] and truth["verdict"] == "conditioning"
    assert set(truth["impl"]) == {"margin", "nrmse", "max_abs"} == set(truth["reference"])
    text = markdown(report)
    assert "## Attribution against the float64 truth" in text
    # the causality checks are bit-exact: no truth applies, and the reason says so
    assert "44 conditioning, 4 n/a" in text and text.count("n/a (bit-exact: no float64 truth applies)") >= 4
    assert "attribution against the float64 truth: 44 conditioning, 4 n/a" in terminal_lines(report)
    plain = markdown(_report(plain_dumps))  # the truth computed here: the same verdicts
    assert "44 conditioning, 4 n/a" in plain and plain.count("n/a (") == plain.count("n/a (bit-exact") >= 4


def test_diff_shows_three_ways_and_where_the_implementation_leaves_the_reference(
    truth_dumps: Path, plain_dumps: Path, capsys
) -> None:
    args = ["diff", "--dumps", str(truth_dumps), "--case", "T65", "--impl", FLIPPED]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "impl vs truth" in out and "ref vs truth" in out and "attribution" in out
    g_row = next(line for line in out.splitlines() if line.lstrip().startswith("gate/beta") and " g " in line)
    assert " impl " in g_row
    assert (
        "the implementation's own error first leaves the reference's at gate/beta (g): margin vs truth" in out
    )
    assert main(["diff", "--dumps", str(truth_dumps), "--case", "T65", "--impl", NUMPY]) == 0
    assert "stays within the relative bound of the reference's at every stage with a truth (17 of 22)" in (
        capsys.readouterr().out
    )
    assert main(["diff", "--dumps", str(plain_dumps), "--case", "T65", "--impl", NUMPY]) == 0
    assert "at every stage with a truth (17 of 22)" in capsys.readouterr().out  # computed here
