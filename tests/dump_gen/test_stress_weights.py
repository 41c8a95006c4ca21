"""`--weights stress`: a valid dump set whose decays are as strong as promised, and the odd-length cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kda_spec.config import get_preset
from kda_spec.dump_format import STANDARD_CASES, select_cases
from kda_spec.synthetic_weights import STRESS_MAX_DECAY_RATE, stress_weights, synthetic_weights
from tests.dump_gen.conftest import dump
from tests.dump_gen.validate import read_npz, validate_set

STRESS_CASES = ["T333", "varlen_70_3"]


@pytest.fixture(scope="module")
def stress_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stress")
    assert dump(out, "--reference", "transformers", "--weights", "stress", cases=STRESS_CASES) == 0
    return out


def test_the_stress_set_is_valid_and_its_gates_reach_strong_decays(stress_set: Path) -> None:
    manifest = validate_set(str(stress_set))
    assert manifest["weights"]["source"] == "synthetic-stress"
    assert [case["id"] for case in manifest["cases"]] == STRESS_CASES
    assert [case["seq_lens"] for case in manifest["cases"]] == [[333], [70, 3]]
    weights = read_npz(str(stress_set), manifest["weights"]["file"], manifest["weights"]["sha256"])
    assert float(np.exp(weights["A_log"]).max()) == pytest.approx(STRESS_MAX_DECAY_RATE)
    for case in manifest["cases"]:
        g = read_npz(str(stress_set), case["file"], case["sha256"])["g"]
        assert g.min() < -30, f"{case['id']}: per-token g only reaches {g.min()}"


def test_stress_weights_change_only_the_decay_parameters() -> None:
    config = get_preset("mini")
    plain, stress = synthetic_weights(config, seed=3), stress_weights(config, seed=3)
    changed = sorted(name for name in plain if not np.array_equal(plain[name], stress[name]))
    assert changed == ["A_log", "dt_bias"]
    assert all(stress[name].dtype == np.float32 and stress[name].shape == plain[name].shape for name in plain)


def test_the_odd_cases_are_selectable_but_not_standard() -> None:
    assert [case.case_id for case in select_cases(STRESS_CASES)] == STRESS_CASES
    assert {"T333", "varlen_70_3"}.isdisjoint(case.case_id for case in STANDARD_CASES)
    assert len(select_cases(None)) == 12


def test_bad_weights_kind_and_stress_with_a_checkpoint_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert dump(tmp_path / "a", "--weights", "heavy") == 2
    assert "--weights must be one of ['synthetic', 'stress'], got 'heavy'" in capsys.readouterr().err
    assert dump(tmp_path / "b", "--weights", "stress", "--checkpoint", str(tmp_path), "--layer", "0") == 2
    assert "--weights stress draws synthetic weights; --checkpoint reads real ones" in capsys.readouterr().err
