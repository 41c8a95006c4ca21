"""The torch references a dump can be made from, chosen by `--reference`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kda_spec.config import KDAConfig

if TYPE_CHECKING:
    from dump_gen.references.base import Reference

REFERENCES = ("transformers", "fla", "hf-hub")


def make_reference(name: str, config: KDAConfig, device: str, hub_snapshot: str | None = None) -> Reference:
    """The reference `name` for layers of `config`'s shape on `device` (`hub_snapshot`: for hf-hub)."""
    if name == "hf-hub":
        from dump_gen.references.hf_hub import HubReference

        return HubReference(config, device, hub_snapshot)
    from dump_gen.references.transformers_layer import FlaReference, TransformersReference

    return {"transformers": TransformersReference, "fla": FlaReference}[name](config, device)
