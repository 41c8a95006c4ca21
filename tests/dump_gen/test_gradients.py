"""The reference's gradients in a dump (dump_gen.gradients): the derivative of the float64 truth, for the
seeded cotangents it stores beside them, only for the cases it is asked to, and why the CPU kernel
gradients come from fla's token recurrence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conformance.dumps.reader import DumpSet
from dump_gen.kernels import CHUNK_SIZE
from kda_spec import dump_format as fmt
from kda_spec.gradients import GRADIENT_KEYS, kernel_cotangents, layer_cotangents, layer_gradient_results
from kda_spec.layer_vjp import layer_vjp
from kda_spec.truth import l2_normalised, packed_delta_rule_vjp, run_hidden_states, run_weights
from tests.dump_gen.conftest import CASES, dump

pytestmark = pytest.mark.torch
GOLDEN = Path(__file__).resolve().parents[2] / "golden"
# nRMSE against the float64 truth: fp32 within a few fp32 roundings of the backward, bf16 within a few bf16
# ones (measured on the tiny set: at most 1.8e-6 (T65's dt_bias) and 3.1e-2 (T1's q_proj: one token's
# roundings); on golden 6.9e-6 (T8's A_log: 2 values whose terms cancel) and 8.7e-3).
WITHIN = {"fp32": 1e-5, "bf16": 6e-2}


def _nrmse(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(found, np.float64) - truth) / np.linalg.norm(truth))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_reference_gradients_are_the_derivative_of_the_float64_truth(
    transformers_set: Path, dtype
) -> None:
    """Every layer and kernel gradient of every case of the tiny set (all three are <= 65 tokens), against
    kda_spec's float64 backward on the same inputs and the stored cotangents."""
    dumps = DumpSet(str(transformers_set))
    weights = run_weights(dumps.weights(), dtype, dumps.config)
    for case_id in CASES:
        case = dumps.case(case_id)
        dout, dht = (case.result(key, dtype) for key in ("grad_layer_dout", "grad_layer_dht"))
        hidden = run_hidden_states(case.hidden_states, dtype)
        truth = layer_vjp(weights, hidden, case.cu_seqlens, case.initial_state, dumps.config, dout, dht)
        for name, value in layer_gradient_results(truth, dumps.config).items():
            if np.any(value):  # a one-token case from zero states: the gate's gradients are zero
                assert _nrmse(case.result(f"grad_layer_{name}", dtype), value) < WITHIN[dtype], (
                    case_id,
                    name,
                )
        stages = (case.result(name, dtype) for name in ("q_after_conv", "k_after_conv", "v_after_conv"))
        q, k, v = (np.asarray(stage, np.float32) for stage in stages)
        do, kernel_dht = (case.result(key, dtype) for key in ("grad_chunk_do", "grad_chunk_dht"))
        kernel = packed_delta_rule_vjp(
            *(np.asarray(x, np.float64) for x in (l2_normalised(q), l2_normalised(k), v)),
            *(np.asarray(case.result(name, dtype), np.float64) for name in ("g", "beta")),
            case.cu_seqlens, case.initial_state, do, kernel_dht,
        )  # fmt: skip
        for name, value in kernel.items():
            if np.any(value):
                assert _nrmse(case.result(f"grad_chunk_{name}", dtype), value) < 1e-5, (case_id, name)


def test_the_stored_cotangents_are_the_seeded_ones(transformers_set: Path) -> None:
    dumps = DumpSet(str(transformers_set))
    for case_id in CASES:
        case = dumps.case(case_id)
        shape = (case_id, case.info.total_tokens, len(case.info.seq_lens), dumps.config)
        for dtype in fmt.DTYPES:
            for keys, seeded in (
                (("grad_chunk_do", "grad_chunk_dht"), kernel_cotangents(shape[0], dtype, *shape[1:])),
                (("grad_layer_dout", "grad_layer_dht"), layer_cotangents(shape[0], dtype, *shape[1:])),
            ):
                for key, array in zip(keys, seeded):
                    np.testing.assert_array_equal(case.result(key, dtype), array, err_msg=f"{case_id} {key}")


def test_only_the_named_cases_carry_gradients(tmp_path: Path) -> None:
    assert dump(tmp_path / "set", "--gradient-cases", "T64", cases=["T65", "T64"]) == 0
    dumps = DumpSet(str(tmp_path / "set"))
    keys = {case_id: set(dumps.case(case_id).arrays) for case_id in ("T64", "T65")}
    every = {fmt.result_key(name, dtype) for name in GRADIENT_KEYS for dtype in fmt.DTYPES}
    assert every <= keys["T64"] and not every & keys["T65"]
    assert dumps.manifest["reference"]["gradients"]["cases"] == ["T64"]


@pytest.mark.parametrize(
    ("named", "message"),
    [
        (["T8"], "--gradient-cases ['T8']: not among the set's cases ['T1', 'T65', 'varlen_initstate']"),
        (["T65", "long"], "--gradient-cases ['long']: not among the set's cases"),
    ],
)
def test_a_gradient_case_outside_the_set_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], named: list[str], message: str
) -> None:
    assert dump(tmp_path / "set", "--gradient-cases", *named) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "set").exists()


def test_a_long_case_has_no_gradients_to_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dump(tmp_path / "set", "--gradient-cases", "long_T16384", cases=["T1", "long"]) == 2
    assert "--gradient-cases ['long_T16384']: a long case stores no gradients" in capsys.readouterr().err


def test_fla_naive_chunk_backward_is_nan_where_its_masked_decays_overflow() -> None:
    """Why a CPU dump's kernel gradients come from fla's token recurrence (`NaiveKernels.VJP_PATH`): golden's
    T65 gates overflow `exp(g_i - g_j)` above a 64-token chunk's diagonal, which naive_chunk_kda computes
    before masking; its forward is finite, its backward NaN. naive_recurrent_kda's backward is finite."""
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    case = DumpSet(str(GOLDEN)).case("T65")
    q, k, v, g = (
        torch.from_numpy(np.asarray(case.result(name, "fp32"), np.float32)[None, :CHUNK_SIZE]).clone()
        for name in ("q_after_conv", "k_after_conv", "v_after_conv", "g")
    )
    beta = torch.from_numpy(case.result("beta", "fp32")[None, :CHUNK_SIZE]).clone()
    q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    finite = {}
    for kernel in (naive_chunk_kda, naive_recurrent_kda):
        leaves = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone(), g.clone(), beta.clone())]
        o, _ = kernel(*leaves, output_final_state=True)
        (grad_g,) = torch.autograd.grad(o.sum(), leaves[3])
        finite[kernel.__name__] = (bool(torch.isfinite(o).all()), bool(torch.isfinite(grad_g).all()))
    assert finite == {"naive_chunk_kda": (True, False), "naive_recurrent_kda": (True, True)}
