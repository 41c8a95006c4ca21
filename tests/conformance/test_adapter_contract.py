"""The adapter contract as docs/adapters.md writes it: its skeleton runs as written, options are checked,
the protocols a class declares are what it provides."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.adapter import (
    OPTIONAL_SERVING_CALLS,
    PROTOCOLS,
    KDAAdapter,
    KernelAdapter,
    LayerAdapter,
    ServingAdapter,
    load_adapter_class,
    parse_option_pairs,
    protocol_calls,
    protocol_error,
    provided_calls,
    unprovided,
)
from conformance.adapters.kda_impl_adapter import KDAImplAdapter
from conformance.checks import kinds
from conformance.checks.catalogue import CheckSkipped, plan
from conformance.checks.runner import CheckRunner
from conformance.dumps.reader import DumpSet
from conformance.policy import TolerancePolicy
from conformance.reports.check_record import summary

REPO = Path(__file__).resolve().parents[2]
ADAPTERS_DOC = REPO / "docs" / "adapters.md"
KERNEL_CHECKS = [kind.name() for kind in kinds.KERNEL_KINDS]
RAW_GATE_CALLS = ("chunk_kernel_raw_gate", "recurrent_kernel_raw_gate")
CHECKPOINT_CALLS = ("chunk_kernel_checkpoints",)


def _skeleton_source() -> str:
    text = ADAPTERS_DOC.read_text()
    section = text[text.index("## A minimal adapter") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def skeleton_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("skeleton")
    (folder / "my_adapter.py").write_text(_skeleton_source())
    return folder


@pytest.fixture(scope="module")
def skeleton_class(skeleton_dir: Path) -> type[KDAAdapter]:
    spec = importlib.util.spec_from_file_location("my_adapter", skeleton_dir / "my_adapter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MyAdapter


def test_skeleton_passes_the_kernel_checks_and_skips_the_rest(
    skeleton_class: type[KDAAdapter], synthetic_dumps: Path
) -> None:
    dumps = DumpSet(str(synthetic_dumps))
    runner = CheckRunner(dumps, skeleton_class, "auto", TolerancePolicy.load(), {"jit": "true"})
    passed, skipped, other = [], [], []
    for spec in plan(dumps, dumps.case_ids(), ["fp32", "bf16"]):
        try:
            comparison = runner.run(spec).comparison
        except CheckSkipped as skip:
            skipped.append((spec.check, str(skip)))
            continue
        if comparison.passed:
            passed.append(spec.check)
        else:
            other.append(f"{spec.id}: {summary(comparison)}")
    assert other == []
    causal = [check for check in passed if check == kinds.KERNEL_CHUNK_CAUSAL.name()]  # the kernel's, too
    assert causal and sorted(check for check in passed if check not in causal) == sorted(
        KERNEL_CHECKS * len(dumps.case_ids()) * 2
    )
    no_gradient = "adapter 'my-kda' implements no gradient protocol (conformance.adapter.GradientAdapter)"
    assert {check for check, reason in skipped if reason == no_gradient} >= {"kernel-chunk-grad-q"}
    no_layer = "adapter 'my-kda' implements no layer protocol (conformance.adapter.LayerAdapter)"
    layer_skips = {check for check, reason in skipped if reason == no_layer}
    assert {"layer", "layer-state", "o_norm", "decode-k1", "chunked-prefill"} <= layer_skips


def test_skeleton_runs_from_the_command_line_with_its_option(
    skeleton_dir: Path, synthetic_dumps: Path
) -> None:
    reports = skeleton_dir / "reports"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(skeleton_dir), str(REPO)])}
    command = [sys.executable, "-m", "conformance", "run", "--dumps", str(synthetic_dumps)]
    command += ["--impl", "my_adapter:MyAdapter", "--impl-option", "jit=false", "--cases", "T8"]
    command += ["--dtypes", "fp32", "--report-dir", str(reports)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((reports / "report.json").read_text())
    assert report["implementation"]["options"] == {"jit": "false"}
    statuses = {check["check"]: check["status"] for check in report["checks"]}
    assert {statuses[check] for check in KERNEL_CHECKS} == {"passed"}
    assert statuses["layer"] == "skipped"


class NoProtocol(KDAAdapter):
    name = "no protocol"


class UndeclaredServing(KernelAdapter):
    name = "undeclared serving"

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        raise NotImplementedError

    recurrent_kernel = chunk_kernel

    def serving_open(self, num_slots):
        raise NotImplementedError


class HalfALayer(LayerAdapter):
    def layer_extend(self, hidden_states, cu_seqlens, initial_state=None, carry=None):
        raise NotImplementedError


def test_what_a_class_provides_is_the_calls_of_the_protocols_it_declares(
    skeleton_class: type[KDAAdapter],
) -> None:
    assert provided_calls(skeleton_class) == {"chunk_kernel", "recurrent_kernel"}
    assert provided_calls(KDAImplAdapter) == {
        *kinds.DECODE_CALLS,
        "chunk_kernel",
        "recurrent_kernel",
        *RAW_GATE_CALLS,
        *CHECKPOINT_CALLS,
        *kinds.GRADIENT_CALLS,
        *kinds.LAYER_GRADIENT_CALLS,
        *kinds.SERVING_CALLS,
        *OPTIONAL_SERVING_CALLS,
    }  # fmt: skip
    assert provided_calls(NoProtocol) == frozenset()
    assert unprovided(skeleton_class, kinds.KERNEL_CHUNK.needs) is None
    assert unprovided(skeleton_class, kinds.KERNEL_CHUNK_RAW_GATE.needs) == (
        "adapter 'my-kda' implements no raw-gate-kernel protocol (conformance.adapter.RawGateKernelAdapter)"
    )
    assert unprovided(skeleton_class, kinds.KERNEL_CHUNK_CHECKPOINTS.needs) == (
        "adapter 'my-kda' implements no checkpoint-kernel protocol "
        "(conformance.adapter.CheckpointKernelAdapter)"
    )
    assert unprovided(skeleton_class, kinds.SERVING.needs) == (
        "adapter 'my-kda' implements no layer protocol (conformance.adapter.LayerAdapter) "
        "and no serving protocol (conformance.adapter.ServingAdapter)"
    )
    assert (
        issubclass(KDAImplAdapter, (LayerAdapter, ServingAdapter)) and protocol_error(KDAImplAdapter) is None
    )


def test_the_kinds_need_the_calls_of_the_protocols() -> None:
    assert [protocol_calls(protocol) for protocol in PROTOCOLS] == [
        kinds.DECODE_CALLS, ("chunk_kernel", "recurrent_kernel"), RAW_GATE_CALLS, CHECKPOINT_CALLS,
        kinds.GRADIENT_CALLS, kinds.LAYER_GRADIENT_CALLS, kinds.SERVING_CALLS,
    ]  # fmt: skip
    every_call = {call for protocol in PROTOCOLS for call in protocol_calls(protocol)}
    assert {call for kind in kinds.KINDS for call in kind.needs} == every_call


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        (
            "NoProtocol",
            "class 'NoProtocol' implements no adapter protocol: subclass one or more of "
            "conformance.adapter.LayerAdapter, conformance.adapter.KernelAdapter, "
            "conformance.adapter.RawGateKernelAdapter, conformance.adapter.CheckpointKernelAdapter, "
            "conformance.adapter.GradientAdapter, conformance.adapter.LayerGradientAdapter, "
            "conformance.adapter.ServingAdapter",
        ),
        (
            "UndeclaredServing",
            "class 'UndeclaredServing' defines serving_open but does not declare "
            "conformance.adapter.ServingAdapter among its bases, so the suite would never call them",
        ),
        ("HalfALayer", "class 'HalfALayer' does not define layer_decode of the protocols it declares"),
    ],
)
def test_a_class_that_is_no_usable_adapter_is_refused_in_one_line(attr: str, message: str) -> None:
    spec = f"{__name__}:{attr}"
    with pytest.raises(ValueError) as raised:
        load_adapter_class(spec)
    assert str(raised.value) == f"--impl {spec!r}: {message}"


def test_skeleton_refuses_a_bad_option(skeleton_class: type[KDAAdapter]) -> None:
    assert skeleton_class.parse_options({}) == {"jit": True}
    with pytest.raises(ValueError, match=r"option jit='maybe' must be true or false"):
        skeleton_class.parse_options({"jit": "maybe"})
    with pytest.raises(ValueError, match=r"adapter 'my-kda' has no option \['speed'\]; it accepts: jit \("):
        skeleton_class.parse_options({"speed": "1"})


def test_builtin_adapter_parses_its_mesh_options() -> None:
    assert KDAImplAdapter.parse_options({}) == {"tp": 1, "dp": 1}
    with pytest.raises(ValueError, match=r"option tp='two' must be a positive integer"):
        KDAImplAdapter.parse_options({"tp": "two"})
    with pytest.raises(ValueError, match=r"option dp='0' must be a positive integer"):
        KDAImplAdapter.parse_options({"dp": "0"})
    with pytest.raises(ValueError, match=r"tp=64 x dp=1 needs 64 devices"):
        KDAImplAdapter.parse_options({"tp": "64"})
    with pytest.raises(ValueError, match=r"has no option \['interpret'\]; it accepts: tp \(.*\), dp \("):
        KDAImplAdapter.parse_options({"interpret": "true"})


def test_option_pairs_are_key_value() -> None:
    assert parse_option_pairs(["tp=2", "path=a=b", "empty="]) == {"tp": "2", "path": "a=b", "empty": ""}
    with pytest.raises(ValueError, match=r"--impl-option 'tp': expected KEY=VALUE"):
        parse_option_pairs(["tp"])
    with pytest.raises(ValueError, match=r"--impl-option 'tp' given twice \('1', '2'\)"):
        parse_option_pairs(["tp=1", "tp=2"])


def test_adapter_docs_state_axes_and_dtypes_the_code_uses() -> None:
    """The state layout the docs give, S[k, v], is the one the reference recurrence uses."""
    import numpy as np

    from kda_spec.truth import packed_delta_rule

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 1, 3)).astype(np.float32) for _ in range(3))
    k /= np.linalg.norm(k)
    g = np.array([[[-0.1, -1.0, -3.0]]], np.float32)
    beta = np.full((1, 1), 0.5, np.float32)
    state = rng.normal(size=(1, 1, 3, 3)).astype(np.float32)
    _, final = packed_delta_rule(q, k, v, g, beta, np.array([0, 1]), state)
    decayed = np.exp(g[0, 0])[:, None] * state[0, 0]  # the decay scales rows: the key axis is first
    expected = decayed + beta[0, 0] * np.outer(k[0, 0], v[0, 0] - k[0, 0] @ decayed)
    np.testing.assert_allclose(final[0, 0], expected, rtol=1e-6, atol=1e-6)
    assert "S'[k, v] = exp(g_t[k]) * S[k, v]" in ADAPTERS_DOC.read_text()
