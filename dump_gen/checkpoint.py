"""One KDA layer's weights from a real checkpoint folder, through the project's one reader
(`kda_spec.checkpoint`), its errors turned into `DumpError`s."""

from __future__ import annotations

import numpy as np

from dump_gen.errors import DumpError
from kda_spec.checkpoint import CheckpointError, read_checkpoint_layer
from kda_spec.config import KDAConfig


def checkpoint_source(directory: str, layer: int) -> str:
    """The manifest's `weights.source` for this layer of this checkpoint."""
    return f"checkpoint:{directory}@{layer}"


def read_layer(directory: str, layer: int, config: KDAConfig) -> dict[str, np.ndarray]:
    """The KDA weights of 0-based `layer` under their HF names, float32; DumpError naming what is wrong."""
    try:
        return read_checkpoint_layer(directory, layer, config)
    except CheckpointError as err:
        raise DumpError(str(err)) from None
