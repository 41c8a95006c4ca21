"""The torch references read their weight layout from their own modules and check it against the contract."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import dump_gen.references.layout as layout
from dump_gen.errors import DumpError
from dump_gen.references import make_reference
from kda_spec.config import get_preset
from kda_spec.synthetic_weights import synthetic_weights
from kda_spec.weight_names import hf_weight_shapes
from tests.dump_gen.conftest import STANDIN

pytestmark = pytest.mark.torch

CONFIG = get_preset("mini").replace(hidden_size=32, head_dim=16)


@pytest.fixture(params=["transformers", "hf-hub"])
def reference(request: pytest.FixtureRequest, tmp_path: Path):
    snapshot = None
    if request.param == "hf-hub":
        snapshot = str(shutil.copytree(STANDIN, tmp_path / "snapshot"))
    return make_reference(request.param, CONFIG, "cpu", snapshot)


def test_reference_layers_match_the_contract(reference) -> None:
    runner = reference.build(synthetic_weights(CONFIG, seed=0), torch.float32)
    assert runner.layer is not None


def test_a_wrong_contract_entry_fails_by_name(reference, monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_table(config):
        shapes = hf_weight_shapes(config)
        shapes["f_b_proj.weight"] = shapes["f_b_proj.weight"][::-1]  # [D, P] instead of [P, D]
        del shapes["o_norm.weight"]
        return shapes

    monkeypatch.setattr(layout, "hf_weight_shapes", wrong_table)
    with pytest.raises(DumpError) as err:
        reference.build(synthetic_weights(CONFIG, seed=0), torch.float32)
    message = str(err.value)
    assert "f_b_proj.weight: the reference layer has shape [32, 16], the contract says [16, 32]" in message
    assert "o_norm.weight: not in the contract" in message


def test_module_layout_costs_no_memory_at_the_real_size() -> None:
    module = torch.nn.Linear(2304, 4096, bias=False, device="meta")
    assert layout.module_layout(module) == {"weight": (4096, 2304)}
