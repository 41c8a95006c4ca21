"""The one writer of a dump set (format v1, docs/dump-format.md): its weights and case files, each with
its sha256, and the manifest that names them, written last.

`dump_gen`, the search's reproducers and the tests' synthetic sets all write through `DumpSetWriter`;
where the files go, and how a run that stops early is undone, is `kda_spec.storage`'s job.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

import numpy as np

from kda_spec import dump_format as fmt
from kda_spec.config import KDAConfig
from kda_spec.storage import DumpWriter, npz_bytes


@dataclasses.dataclass(frozen=True)
class TruthBlock:
    """The manifest's `truth` block: which truth names the set holds, computed how, and up to how many
    tokens a case gets the intermediates' truth (None: the block leaves the field out)."""

    implementation: str
    names: tuple[str, ...]
    intermediates_max_tokens: int | None = None

    def as_manifest(self) -> dict[str, Any]:
        block: dict[str, Any] = {"dtype": fmt.TRUTH_DTYPE, "implementation": self.implementation}
        block["names"] = list(self.names)
        if self.intermediates_max_tokens is not None:
            block["intermediates_max_tokens"] = self.intermediates_max_tokens
        return block


def case_group_fields(case: fmt.CaseSpec) -> dict[str, Any]:
    """The manifest fields of a case in a group: its `group` and, where it has them, its `decode_steps`
    (none for the standard and extra cases)."""
    fields: dict[str, Any] = {} if case.group is None else {"group": case.group}
    if case.decode_steps:
        fields["decode_steps"] = case.decode_steps
    return fields


def case_entry(
    case: fmt.CaseSpec,
    sha256: str,
    keys: list[str],
    layer_kernel_path: str,
    layer_kernel_path_per_seq: list[str] | None,
) -> dict[str, Any]:
    """A case's manifest entry; `group` and `decode_steps` only where the case has them."""
    entry: dict[str, Any] = {
        "id": case.case_id,
        "file": case.file,
        "sha256": sha256,
        "seq_lens": list(case.seq_lens),
        "initial_state": case.initial_state,
        "layer_kernel_path": layer_kernel_path,
    }
    if layer_kernel_path_per_seq is not None:
        entry["layer_kernel_path_per_seq"] = layer_kernel_path_per_seq
    return {**entry, **case_group_fields(case), "keys": keys}


def now() -> str:
    """The manifest's `created` time: now, UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class DumpSetWriter:
    """Writes one dump set to `destination`: `write_weights` once, `write_case` per case as each is
    computed (so a run holds one case's arrays at a time), then `commit` the manifest."""

    def __init__(self, destination: DumpWriter):
        self.destination = destination
        self.weights_block: dict[str, str] | None = None
        self.case_entries: list[dict[str, Any]] = []

    def write_weights(self, weights: Mapping[str, np.ndarray], source: str) -> None:
        """weights.npz of `weights` in their order, and the manifest's `weights` block naming `source`."""
        sha256 = self.destination.write(fmt.WEIGHTS_FILE, npz_bytes(dict(weights)))
        self.weights_block = {"file": fmt.WEIGHTS_FILE, "sha256": sha256, "source": source}

    def write_case(
        self,
        case: fmt.CaseSpec,
        arrays: Mapping[str, np.ndarray],
        *,
        layer_kernel_path: str = "chunk",
        layer_kernel_path_per_seq: list[str] | None = None,
        sorted_keys: bool = False,
    ) -> None:
        """The case file of `arrays` in their order, and its manifest entry, which lists the file's keys
        in that order (sorted with `sorted_keys`)."""
        sha256 = self.destination.write(case.file, npz_bytes(dict(arrays)))
        keys = sorted(arrays) if sorted_keys else list(arrays)
        self.case_entries.append(case_entry(case, sha256, keys, layer_kernel_path, layer_kernel_path_per_seq))

    def commit(
        self,
        *,
        config: KDAConfig,
        reference: Mapping[str, Any],
        seed: int,
        generator: str,
        truth: TruthBlock | None = None,
        precision: Mapping[str, Any] | None = None,
        search: Mapping[str, Any] | None = None,
        created: str | None = None,
    ) -> dict[str, Any]:
        """Write the manifest, last, and return it. `precision`: how the reference's fp32 arithmetic ran;
        `search`: what the search says of its case; each block left out when None. `created`: now when
        None."""
        if self.weights_block is None:
            raise ValueError("a dump set needs its weights: call write_weights before commit")
        manifest: dict[str, Any] = {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "config": config.to_manifest(),
            "reference": dict(reference),
        }
        if precision is not None:
            manifest[fmt.PRECISION_BLOCK] = dict(precision)
        manifest["seed"] = seed
        manifest["weights"] = self.weights_block
        manifest["created"] = now() if created is None else created
        manifest["generator"] = generator
        if truth is not None:
            manifest["truth"] = truth.as_manifest()
        manifest["cases"] = self.case_entries
        if search is not None:
            manifest["search"] = dict(search)
        self.destination.commit(manifest)
        return manifest
