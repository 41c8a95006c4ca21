"""What a run ran on, from injected platform facts: report.json's `environment.platform`, the report's
first lines and the interpret warning, and the gate's platform requirement."""

from __future__ import annotations

from typing import Any

import jax
import pytest

from conformance.reports.platform import platform_lines, platform_markdown
from conformance.runtime.matmul_precision import default_meaning
from conformance.runtime.run_platform import (
    check_required_platform,
    kernel_execution,
    platform_block,
    platform_name,
)
from conformance.tools.gate import platform_breaches

CPU = {"name": "cpu", "backend": "cpu", "device_kind": "cpu", "device_count": 1, "process_count": 1}
TPU = {"name": "tpu", "backend": "tpu", "device_kind": "TPU v5 lite", "device_count": 4, "process_count": 1}


def _report(kernel_used: dict[str, str], platform: dict[str, Any]) -> dict[str, Any]:
    return {"environment": {"platform": platform_block(kernel_used, platform)}}


def test_the_platform_block_records_the_run_s_matmul_precision() -> None:
    assert platform_block({"fp32": "naive (xla, cpu)"}, TPU)["matmul_precision"] == {
        "jax_default_matmul_precision": None,
        "default_means": default_meaning("tpu"),
    }
    with jax.default_matmul_precision("highest"):
        block = platform_block({"fp32": "naive (xla, cpu)"}, CPU)["matmul_precision"]
    assert block["jax_default_matmul_precision"] == "highest"
    line = platform_lines({"environment": {"platform": {**CPU, "matmul_precision": block}}})[-1]
    assert (
        line
        == "matmul precision: jax_default_matmul_precision='highest'; an fp32 dot at DEFAULT here is fp32"
    )
    # A report made before the record has no matmul line.
    assert len(platform_lines({"environment": {"platform": {**CPU, "kernels": {}}}})) == 2


def test_default_precision_means_tf32_on_sm80_and_later() -> None:
    assert default_meaning("cuda", "9.0").startswith("TF32")
    assert default_meaning("cuda", "8.0").startswith("TF32")
    assert default_meaning("cuda", "7.5") == "fp32"
    assert "sm80+" in default_meaning("cuda")
    assert default_meaning("rocm") == "not known to this suite on rocm"


def test_platform_names_tell_cuda_from_rocm() -> None:
    assert platform_name("gpu", "PJRT C API\ncuda 12080") == "cuda"
    assert platform_name("gpu", "rocm 60302") == "rocm"
    assert platform_name("tpu", "PJRT C API\nTFRT TPU v5 lite") == "tpu"
    assert platform_name("cpu", "cpu") == "cpu"


def test_a_plain_pallas_on_a_cpu_is_the_interpreter() -> None:
    assert kernel_execution("pallas", "cpu") == "pallas (interpret, cpu)"
    assert kernel_execution("pallas", "tpu") == "pallas"  # an adapter that does not say: not guessed
    assert kernel_execution("pallas (mosaic, tpu)", "tpu") == "pallas (mosaic, tpu)"
    block = platform_block({"fp32": "pallas", "bf16": "naive (xla, cpu)"}, CPU)
    assert block["kernels"] == {"fp32": "pallas (interpret, cpu)", "bf16": "naive (xla, cpu)"}
    assert block["pallas_interpreted"] == ["fp32"]
    assert platform_block({"fp32": "pallas (mosaic, tpu)"}, TPU)["pallas_interpreted"] == []


def test_first_lines_name_the_platform_and_how_the_kernels_ran() -> None:
    native = _report({"fp32": "pallas (mosaic, tpu)", "bf16": "pallas (mosaic, tpu)"}, TPU)
    assert platform_lines(native) == [
        "platform: tpu, TPU v5 lite ×4 (JAX backend tpu)",
        "kernels: pallas (mosaic, tpu) (fp32, bf16)",
        "matmul precision: jax_default_matmul_precision unset; an fp32 dot at DEFAULT here is one bf16 "
        "pass per matmul (bf16 operands, fp32 accumulation)",
    ]
    mixed = _report({"fp32": "naive (xla, cpu)", "bf16": "pallas (interpret, cpu)"}, CPU)
    warning = "WARNING: Pallas ran in interpret mode on cpu (bf16): this says nothing about Mosaic on a TPU"
    assert platform_lines(mixed) == [
        "platform: cpu, cpu ×1 (JAX backend cpu)",
        "kernels: fp32: naive (xla, cpu); bf16: pallas (interpret, cpu)",
        "matmul precision: jax_default_matmul_precision unset; an fp32 dot at DEFAULT here is fp32",
        warning,
    ]
    assert platform_markdown(mixed)[-1] == f"**{warning}**"
    assert platform_lines({"environment": {}}) == ["platform: not recorded in this report"]


def test_required_platform_fails_another_platform_and_interpreted_pallas() -> None:
    on_cpu = _report({"fp32": "pallas (interpret, cpu)"}, CPU)
    assert platform_breaches(on_cpu, "tpu") == [
        "platform: required tpu, the report was made on cpu, cpu ×1",
        "platform: required tpu, but the fp32 kernels ran pallas (interpret, cpu): Pallas interpreted, "
        "never compiled",
    ]
    assert platform_breaches(on_cpu, "cpu") == []  # on a CPU, the interpreter is all Pallas has
    interpreted_on_tpu = _report({"bf16": "pallas (interpret, tpu)"}, TPU)
    assert platform_breaches(interpreted_on_tpu, "tpu") == [
        "platform: required tpu, but the bf16 kernels ran pallas (interpret, tpu): Pallas interpreted, "
        "never compiled"
    ]
    assert platform_breaches(_report({"fp32": "pallas (mosaic, tpu)"}, TPU), "tpu") == []
    assert platform_breaches({"environment": {}}, "tpu") == [
        "platform: required tpu, but the report records none (environment.platform)"
    ]


def test_the_requirement_is_recomputed_from_the_recorded_kernels() -> None:
    """A report whose list of interpreted dtypes was emptied still fails: the kernels say it."""
    report = _report({"fp32": "pallas"}, CPU)
    report["environment"]["platform"]["pallas_interpreted"] = []
    assert len(platform_breaches(report, "tpu")) == 2
    report["environment"]["platform"]["kernels"] = ["pallas"]
    assert platform_breaches(report, "cpu") == [
        "platform: 'kernels' must map each dtype to a string, found ['pallas']"
    ]


@pytest.mark.parametrize("value", ["gpu", "TPU", "", 1, None])
def test_only_known_platforms_can_be_required(value: Any) -> None:
    with pytest.raises(ValueError, match=r"\[platform\] require must be one of \['cpu', 'tpu', 'cuda'\]"):
        check_required_platform(value, "[platform] require")
