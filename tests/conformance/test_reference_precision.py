"""The checker reads how a dump set's fp32 reference computed (the manifest's `precision` block): a set
recorded with TF32, or made on a CUDA device without the block, is warned about on one line in
report.json, the terminal and report.md, and its fp32 checks whose absolute limits fail say so."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance.adapter import LayerResult
from conformance.cli import main
from conformance.dumps.reader import DumpError, DumpSet
from conformance.dumps.reference_precision import IEEE, TF32, UNKNOWN, reference_precision
from conformance.reports.render import terminal_lines
from tests.conformance.numpy_adapter import NumpyAdapter
from tests.conformance.synthetic import write_dump_set

# What dump_gen writes on an H100 with use_ieee_fp32 (dump_gen/precision.py).
IEEE_ON_H100 = {
    "triton_f32_default": "ieee",
    "torch_matmul_allow_tf32": False,
    "cudnn_allow_tf32": False,
    "float32_matmul_precision": "highest",
    "device": "cuda",
    "device_name": "NVIDIA H100 80GB HBM3",
    "compute_capability": "9.0",
    "torch": "2.7.0",
    "triton": "3.3.0",
}
TF32_ON_H100 = {**IEEE_ON_H100, "triton_f32_default": None, "cudnn_allow_tf32": True}


def _manifest(device: str, precision: dict[str, Any] | None) -> dict[str, Any]:
    manifest: dict[str, Any] = {"reference": {"name": "hf-hub", "device": device}}
    return manifest if precision is None else {**manifest, "precision": precision}


@pytest.mark.parametrize(
    ("device", "precision", "expected"),
    [
        ("cuda: NVIDIA H100 80GB HBM3", IEEE_ON_H100, IEEE),
        ("cuda: NVIDIA H100 80GB HBM3", TF32_ON_H100, TF32),
        ("cuda: NVIDIA H100 80GB HBM3", {**IEEE_ON_H100, "torch_matmul_allow_tf32": True}, TF32),
        ("cuda: NVIDIA H100 80GB HBM3", {**IEEE_ON_H100, "triton": None, "triton_f32_default": None}, IEEE),
        ("cuda: Tesla V100", {**TF32_ON_H100, "compute_capability": "7.0"}, IEEE),  # no TF32 before sm80
        ("cpu", {**TF32_ON_H100, "device": "cpu", "compute_capability": None}, IEEE),  # no TF32 on a CPU
        ("cpu", {**IEEE_ON_H100, "device": "cpu", "float32_matmul_precision": "medium"}, TF32),
        ("cuda: NVIDIA H100 80GB HBM3", None, UNKNOWN),  # a set made before the block
        ("cpu", None, IEEE),  # golden/ and every CPU set made before the block
        ("cpu", {**TF32_ON_H100, "device": None, "compute_capability": None}, IEEE),  # null is allowed
    ],
)
def test_the_reference_precision_follows_the_recorded_settings(
    device: str, precision: dict[str, Any] | None, expected: str
) -> None:
    found = reference_precision(_manifest(device, precision), "manifest.json")
    assert found.fp32 == expected
    assert (found.warning is None) == (expected == IEEE) == (found.failure_note is None)


def test_the_warning_names_what_ran_with_tf32() -> None:
    found = reference_precision(_manifest("cuda", TF32_ON_H100), "manifest.json")
    assert found.reasons == (
        "TRITON_F32_DEFAULT unset: Triton's fp32 tl.dot in TF32",
        "torch cudnn_allow_tf32 on",
    )
    assert found.warning is not None and "\n" not in found.warning
    assert found.warning.startswith(
        "WARNING: the dump's fp32 reference ran with TF32 (TRITON_F32_DEFAULT unset"
    )
    unknown = reference_precision(_manifest("cuda: NVIDIA H100", None), "manifest.json")
    assert "may have run with TF32 (made on cuda: NVIDIA H100 without a 'precision' block" in str(
        unknown.warning
    )


@pytest.mark.parametrize(
    ("block", "named"),
    [
        ("ieee", "'precision' must be an object, found 'ieee'"),
        (
            {**IEEE_ON_H100, "cudnn_allow_tf32": "no"},
            "precision.cudnn_allow_tf32 must be true or false, found 'no'",
        ),
        (
            {**IEEE_ON_H100, "compute_capability": 9.0},
            "precision.compute_capability must be a string or null",
        ),
        (
            {**IEEE_ON_H100, "compute_capability": "sm90"},
            """precision.compute_capability must be MAJOR.MINOR ("9.0") or null, found 'sm90'""",
        ),
    ],
)
def test_a_malformed_block_is_one_error_naming_the_field(tmp_path: Path, block: Any, named: str) -> None:
    root = _set_with(tmp_path, "cpu", block)
    with pytest.raises(DumpError, match=r"manifest\.json: ") as raised:
        DumpSet(str(root))
    assert named in str(raised.value) and "\n" not in str(raised.value)


def _set_with(root: Path, device: str, precision: Any) -> Path:
    write_dump_set(root, ("T8",), dtypes=("fp32",))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["reference"]["device"] = device
    manifest["precision"] = precision
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


class OffByOneThousandth(NumpyAdapter):
    """The numpy reference with its layer output 1e-3 off: fails the fp32 absolute limits."""

    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None) -> LayerResult:
        result = super().layer_extend(hidden_states, cu_seqlens, initial_state, carry)
        return dataclasses.replace(result, out=np.asarray(result.out) + np.float32(1e-3))


@pytest.fixture(scope="module")
def tf32_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = _set_with(tmp_path_factory.mktemp("tf32-set"), "cuda: NVIDIA H100 80GB HBM3", TF32_ON_H100)
    reports = tmp_path_factory.mktemp("tf32-reports")
    shutil.rmtree(reports)
    impl = f"{__name__}:OffByOneThousandth"
    args = [
        "run",
        "--dumps",
        str(root),
        "--impl",
        impl,
        "--report-dir",
        str(reports),
        "-k",
        "layer and not chunked",
    ]
    assert main(args) == 1
    return reports, (reports / "report.md").read_text().splitlines()


def test_the_report_warns_first_about_a_tf32_reference(tf32_run: tuple[Path, list[str]]) -> None:
    reports, markdown = tf32_run
    report = json.loads((reports / "report.json").read_text())
    recorded = report["dumps"]["reference_precision"]
    assert recorded["fp32"] == TF32 and recorded["warning"].startswith("WARNING: the dump's fp32 reference")
    assert f"**{recorded['warning']}**" in markdown[:12]  # with the platform lines, before the summary
    terminal = terminal_lines(report)
    assert terminal[terminal.index(recorded["warning"]) - 1].startswith("matmul precision: ")
    checks = [check for check in report["checks"] if check["status"] == "failed"]
    assert checks and all(check["dtype"] == "fp32" for check in checks)
    note = "the fp32 reference ran with TF32, an error the absolute limits measure too: "
    assert all(check["message"].startswith(note) for check in checks), checks[0]["message"]


def test_an_ieee_set_gets_no_warning(tmp_path: Path) -> None:
    dumps = DumpSet(str(_set_with(tmp_path, "cuda: NVIDIA H100 80GB HBM3", IEEE_ON_H100)))
    assert dumps.reference_precision.as_dict() == {"fp32": IEEE, "reasons": [], "warning": None}
