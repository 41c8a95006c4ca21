"""kda_spec.dump_writer, the one writer of a dump set: the manifest it commits names every file with its
sha256 and every block it is given, and the suite's reader accepts the set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.dumps.reader import DumpSet
from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.dump_writer import DumpSetWriter, TruthBlock
from kda_spec.storage import open_writer, sha256_bytes

CONFIG = KDAConfig(hidden_size=32, num_heads=2, head_dim=8, conv_size=4, rms_norm_eps=1e-5, preset="tiny")
REFERENCE = {"name": "test", "device": "cpu"}


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = fmt.weight_shapes(CONFIG.to_manifest())
    return {name: rng.normal(0, 0.1, shape).astype(np.float32) for name, shape in shapes.items()}


def case_arrays(case: fmt.CaseSpec) -> dict[str, np.ndarray]:
    tokens = case.total_tokens
    return {
        "hidden_states": np.zeros((tokens, CONFIG.hidden_size), np.float32),
        "cu_seqlens": np.concatenate([[0], np.cumsum(case.seq_lens)]).astype(np.int32),
    }


def test_the_manifest_names_every_file_and_block(tmp_path: Path) -> None:
    case = fmt.CASES_BY_ID["varlen_70_3"]
    grouped = fmt.CaseSpec("long_T8", (8,), group="long", decode_steps=4)
    with open_writer(str(tmp_path / "set"), overwrite=False) as destination:
        writer = DumpSetWriter(destination)
        writer.write_weights(weights(), "synthetic")
        writer.write_case(case, case_arrays(case), layer_kernel_path_per_seq=["chunk", "fused_recurrent"])
        writer.write_case(grouped, dict(reversed(list(case_arrays(grouped).items()))))
        manifest = writer.commit(
            config=CONFIG,
            reference=REFERENCE,
            seed=3,
            generator="test",
            truth=TruthBlock("none", ("out",)),
            precision={"device": "cpu"},
            search={"case": "x"},
            created="2026-01-01T00:00:00+00:00",
        )
    assert list(manifest) == [
        "format", "version", "config", "reference", "precision", "seed", "weights", "created", "generator",
        "truth", "cases", "search",
    ]  # fmt: skip
    assert manifest["truth"] == {"dtype": "float64", "implementation": "none", "names": ["out"]}
    first, second = manifest["cases"]
    assert first["layer_kernel_path_per_seq"] == ["chunk", "fused_recurrent"] and "group" not in first
    assert second["keys"] == ["cu_seqlens", "hidden_states"]
    assert (second["group"], second["decode_steps"]) == ("long", 4)
    for entry in (manifest["weights"], first, second):
        assert sha256_bytes((tmp_path / "set" / entry["file"]).read_bytes()) == entry["sha256"]
    assert DumpSet(str(tmp_path / "set")).verify() == []


def test_sorted_keys_lists_the_file_keys_sorted(tmp_path: Path) -> None:
    case = fmt.CASES_BY_ID["T1"]
    arrays = dict(reversed(list(case_arrays(case).items())))
    with open_writer(str(tmp_path / "set"), overwrite=False) as destination:
        writer = DumpSetWriter(destination)
        writer.write_weights(weights(), "synthetic")
        writer.write_case(case, arrays, sorted_keys=True)
        manifest = writer.commit(config=CONFIG, reference=REFERENCE, seed=0, generator="test")
    assert manifest["cases"][0]["keys"] == ["cu_seqlens", "hidden_states"]
    assert "truth" not in manifest and "precision" not in manifest and "search" not in manifest


def test_a_set_without_weights_is_refused(tmp_path: Path) -> None:
    refused = pytest.raises(ValueError, match="call write_weights before commit")
    with refused, open_writer(str(tmp_path / "set"), overwrite=False) as destination:
        DumpSetWriter(destination).commit(config=CONFIG, reference=REFERENCE, seed=0, generator="test")
    assert list(tmp_path.iterdir()) == []  # the staging folder is gone, nothing was written
