"""dump_gen for the glm5-next family: transformers' `Glm5NextTextLinearAttention` and the fla reference
agree with the float64 truth, a set's manifest records the family and its L, the stress weights hold
the gate at its floor, and a GLM-named checkpoint shard is read by its names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dump_gen.checkpoint import read_layer
from dump_gen.cli import main
from dump_gen.errors import DumpError
from dump_gen.inputs import case_inputs
from dump_gen.references import make_reference
from kda_spec.checkpoint import LANGUAGE_MODEL_PREFIX
from kda_spec.config import KDAConfig, get_preset
from kda_spec.dump_format import CASES_BY_ID
from kda_spec.families import GLM5_NEXT, KIMI_LINEAR, canonical_weights
from kda_spec.synthetic_weights import stress_weights, synthetic_weights
from kda_spec.truth import layer_truth
from kda_spec.weight_names import hf_weight_shapes, layer_prefix
from tests.dump_gen.validate import read_npz, validate_set

pytestmark = pytest.mark.torch

GLM_TINY = ["--preset", "glm5-next-mini", "--hidden-size", "32", "--head-dim", "16", "--no-progress"]
CONFIG = get_preset("glm5-next-mini").replace(hidden_size=32, head_dim=16, preset="custom")
CHUNK = 64


def reference_run(reference: str, config: KDAConfig, case_id: str) -> tuple[dict, dict]:
    """The fp32 layer of `reference` on one case with the stress weights, and the truth, by dump name."""
    weights = stress_weights(config, seed=0)
    inputs = case_inputs(CASES_BY_ID[case_id], config, seed=0)
    state = None if inputs.initial_state is None else torch.from_numpy(inputs.initial_state)
    runner = make_reference(reference, config, "cpu").build(weights, torch.float32)
    with torch.no_grad():
        run = runner.run(torch.from_numpy(inputs.hidden_states), inputs, state)
    results = {"out": run.out.numpy(), **{name: a.numpy() for name, a in run.intermediates.items()}}
    truth = layer_truth(weights, inputs.hidden_states, inputs.cu_seqlens, inputs.initial_state, config)
    return results, truth


@pytest.mark.parametrize("reference", ["transformers", "fla"])
def test_the_glm_layer_is_the_truth_at_fp32(reference: str) -> None:
    """A packed batch with initial states and a one-token (decode) sequence: the output and every
    intermediate within the RFC's fp32 tolerance of the float64 truth, the gate at its floor included."""
    results, truth = reference_run(reference, CONFIG, "varlen_initstate")
    for name, value in results.items():
        np.testing.assert_allclose(value, truth[name], atol=1e-5, rtol=1e-5, err_msg=name)
    assert results["g"].min() < 0.99 * CONFIG.gate_lower_bound  # the stress weights reach the floor
    assert results["g"].min() >= CONFIG.gate_lower_bound


def test_the_reference_names_its_layer_and_the_fla_gate() -> None:
    assert make_reference("transformers", CONFIG, "cpu").describe()["layer"] == GLM5_NEXT.reference
    patches = make_reference("fla", CONFIG, "cpu").describe()["patches"]
    assert any("naive_kda_lowerbound_gate" in patch and "lower_bound=-5.0" in patch for patch in patches)
    kimi = get_preset("mini")
    assert make_reference("transformers", kimi, "cpu").describe()["layer"] == KIMI_LINEAR.reference
    assert not any("gate" in patch for patch in make_reference("fla", kimi, "cpu").describe()["patches"])


@pytest.fixture(scope="module")
def glm_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """varlen_70_3 with the stress weights and L overridden to -3: a packed boundary inside a chunk."""
    out = tmp_path_factory.mktemp("glm")
    argv = ["--out", str(out), *GLM_TINY, "--weights", "stress", "--gate-lower-bound", "-3", "--cases"]
    assert main([*argv, "varlen_70_3"]) == 0
    return out


def test_the_manifest_records_the_family_and_its_bound(glm_set: Path) -> None:
    manifest = validate_set(str(glm_set))
    assert manifest["config"]["family"] == GLM5_NEXT.name
    assert manifest["config"]["gate_lower_bound"] == -3.0
    assert manifest["weights"]["source"] == "synthetic-stress"
    weights = read_npz(str(glm_set), manifest["weights"]["file"], manifest["weights"]["sha256"])
    assert set(weights) == set(hf_weight_shapes(CONFIG))  # the family's names: conv1d.weight, forget_gate.*


def test_the_stress_gate_sits_at_its_floor_for_whole_chunks(glm_set: Path) -> None:
    """The regime of sgl-jax PR #1587: every 4th channel's per-token g near L, so that the first 64-token
    chunk's sum of g reaches tens of L there (about 64 L)."""
    manifest = validate_set(str(glm_set))
    case = manifest["cases"][0]
    arrays = read_npz(str(glm_set), case["file"], case["sha256"])
    lower = -3.0
    for key in ("g", "g_fp64"):
        g = arrays[key].astype(np.float64)
        assert g.min() >= lower and g.max() <= 0, key  # fp32 sigmoid reaches 1 (g = L) and 0
        chunk_sum = g[:CHUNK].sum(axis=0)  # [H, D]: the first chunk of the 70-token sequence
        stressed = chunk_sum[:, ::4]
        assert stressed.max() < 50 * lower, f"{key}: a stressed channel's chunk sum is {stressed.max()}"
        assert np.delete(chunk_sum, np.s_[::4], axis=1).max() > 20 * lower, key  # the others decay less
    truth = arrays["out_fp64"]
    assert np.max(np.abs(arrays["out_fp32"] - truth)) <= 1e-5 * (1 + np.max(np.abs(truth)))


def test_a_bound_on_a_family_without_one_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--out", str(tmp_path / "x"), "--preset", "mini", "--gate-lower-bound", "-5"]) == 2
    assert "gate_lower_bound=-5.0 is set, but the kimi-linear family" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "y"), *GLM_TINY, "--gate-lower-bound", "0.5"]) == 2
    assert "gate_lower_bound must be a number in [-1e4, 0)" in capsys.readouterr().err
    hub = ["--reference", "hf-hub", "--hub-snapshot", str(tmp_path)]
    assert main(["--out", str(tmp_path / "z"), *GLM_TINY, *hub]) == 2
    assert "runs the hub's Kimi-Linear modeling file" in capsys.readouterr().err


def test_a_glm_named_shard_is_read_by_its_names(tmp_path: Path) -> None:
    """One shard holding layer 0 under GLM's names (the fused conv [3P, 1, W], `forget_gate.*`, A_log [H])
        in bf16 but the fp32 weights: read back exactly. A Kimi-Linear shard of the same shape has the names
    transformers converts a GLM layer from, and is refused by its `A_log` `[1, 1, H, 1]`."""
    weights = synthetic_weights(CONFIG, seed=5)
    prefix = layer_prefix(0)
    kept = GLM5_NEXT.fp32_weights
    tensors = {
        prefix + name: torch.from_numpy(array) if name in kept else torch.from_numpy(array).bfloat16()
        for name, array in weights.items()
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read = read_layer(str(tmp_path), 0, CONFIG)
    assert read["conv1d.weight"].shape == (3 * CONFIG.proj_dim, 1, CONFIG.conv_size)
    assert read["forget_gate.A_log"].shape == (CONFIG.num_heads,)
    for name, array in weights.items():
        expected = array if name in kept else torch.from_numpy(array).bfloat16().float().numpy()
        np.testing.assert_array_equal(read[name], expected, err_msg=name)

    kimi = get_preset("mini").replace(hidden_size=32, head_dim=16)
    kimi_dir = tmp_path / "kimi"
    kimi_dir.mkdir()
    kimi_tensors = {prefix + n: torch.from_numpy(a) for n, a in synthetic_weights(kimi, seed=5).items()}
    save_file(kimi_tensors, str(kimi_dir / "model.safetensors"))
    with pytest.raises(
        DumpError, match=r"key 'model\.layers\.0\.self_attn\.A_log' has shape \[1, 1, 2, 1\], expected \[2\]"
    ):
        read_layer(str(kimi_dir), 0, CONFIG)


def test_a_shard_as_transformers_converts_it_from_is_read_too(tmp_path: Path) -> None:
    """GLM-5.3-Flash's layer as transformers 5.24.0 loads it (conversion_mapping "glm5_next"): the gate's
    weights without `forget_gate.`, three convs, under `model.language_model.layers.{i}.self_attn.`; read
    as the family's weights, the convs concatenated q | k | v. A conv of the wrong width is named."""
    weights = synthetic_weights(CONFIG, seed=6)
    canonical = canonical_weights(CONFIG, weights)
    stored = {name: canonical[name] for name in canonical if name != "A_log"}
    stored["A_log"] = weights["forget_gate.A_log"]  # [H], as the module holds it
    prefix = LANGUAGE_MODEL_PREFIX.format(layer=0)
    shard = str(tmp_path / "model.safetensors")
    save_file({prefix + n: torch.from_numpy(a) for n, a in stored.items()}, shard)
    read = read_layer(str(tmp_path), 0, CONFIG)
    assert list(read) == list(hf_weight_shapes(CONFIG))
    for name, array in weights.items():
        np.testing.assert_array_equal(read[name], array, err_msg=name)

    stored["k_conv1d.weight"] = np.ascontiguousarray(stored["k_conv1d.weight"][:, :, :-1])
    save_file({prefix + n: torch.from_numpy(a) for n, a in stored.items()}, shard)
    with pytest.raises(DumpError, match=r"q_conv1d\.weight \| .*k_conv1d\.weight .* have different shapes"):
        read_layer(str(tmp_path), 0, CONFIG)
