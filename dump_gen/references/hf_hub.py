"""The `hf-hub` reference: the hub's `KimiDeltaAttention` from a downloaded snapshot, patched (RFC §6.1.5).

`--hub-snapshot DIR` is a local copy of the model's hub repository (`modeling_kimi.py`,
`configuration_kimi.py`, `config.json`); it cannot be fetched here and is never committed. The two files
import each other relatively, so the folder is imported as a package. The layer runs the packed batch in
one call, as a server does: `cu_seqlens` for the varlen cases, the initial states through its
`KimiDynamicCache`. It picks `fused_recurrent_kda` for 64 tokens or fewer and `chunk_kda` above, both
fla Triton kernels, so a real snapshot needs a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dump_gen.capture import KernelRecorder, NormCall, recording_norm, replaced
from dump_gen.errors import DumpError
from dump_gen.inputs import CaseInputs
from dump_gen.references.base import LayerRun, assemble_run, device_description, load_layer, package_versions
from dump_gen.references.hub_patch import PATCH_NOTE, patch_layer_class
from kda_spec.config import KDAConfig

RFC_MODELING_MD5 = "337ae1fc58c7010db4051e30fa23563e"
MODELING_FILE = "modeling_kimi.py"
CONFIGURATION_FILE = "configuration_kimi.py"
CONFIG_JSON = "config.json"
# The hub module's kernel functions, by path, with its names for q, k, v, g, beta.
_KERNEL_FUNCTIONS = {"chunk": "chunk_kda", "fused_recurrent": "fused_recurrent_kda"}
_KERNEL_ARGS = ("q", "k", "v", "g", "beta")


def file_md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def import_snapshot(directory: str) -> tuple[ModuleType, ModuleType]:
    """The snapshot's `modeling_kimi` and `configuration_kimi`, imported as submodules of one package."""
    root = Path(directory)
    for name in (MODELING_FILE, CONFIGURATION_FILE):
        if not (root / name).is_file():
            raise DumpError(
                f"--hub-snapshot {directory}: no {name} there (a download of the model's hub repository)"
            )
    # One package per snapshot folder and file content, so two snapshots never share modules.
    tag = hashlib.md5(f"{root.resolve()}:{file_md5(root / MODELING_FILE)}".encode()).hexdigest()[:16]
    package = f"_kimi_hub_snapshot_{tag}"
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(root)]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    try:
        return (
            importlib.import_module(f"{package}.modeling_kimi"),
            importlib.import_module(f"{package}.configuration_kimi"),
        )
    except Exception as err:  # third-party code: any import failure is the user's environment
        raise DumpError(
            f"cannot import {root / MODELING_FILE}: {type(err).__name__}: {err} (the RFC ran it with "
            "transformers 4.56.2, fla-core 0.4.2 and flash-linear-attention for fla.layers)"
        ) from None


def loud_warning(message: str) -> None:
    bar = "!" * 100
    print(f"{bar}\n!! WARNING: {message}\n{bar}", file=sys.stderr)


class HubReference:
    name = "hf-hub"

    def __init__(self, config: KDAConfig, device: str, snapshot: str):
        self.device = device
        self.modeling, configuration = import_snapshot(snapshot)
        self.md5 = file_md5(Path(snapshot) / MODELING_FILE)
        if self.md5 != RFC_MODELING_MD5:
            loud_warning(
                f"{Path(snapshot) / MODELING_FILE} has md5 {self.md5}, not the RFC's pinned "
                f"{RFC_MODELING_MD5}: another revision of the hub file. The manifest records the md5 used."
            )
        from fla.ops.kda.gate import fused_kda_gate, naive_kda_gate

        # fla's current gate: its Triton kernel on a GPU, its torch reference (same signature) on a CPU.
        self.gate = naive_kda_gate if device == "cpu" else fused_kda_gate
        self.layer_class = patch_layer_class(self.modeling, self.gate)
        self.hub_config = configuration.KimiLinearConfig(**_hub_config_fields(Path(snapshot), config))

    def describe(self) -> dict[str, Any]:
        return {
            "versions": package_versions(),
            "device": device_description(self.device),
            "modeling_file_md5": self.md5,
            "patches": [f"{PATCH_NOTE}; current gate: fla.ops.kda.gate.{self.gate.__name__}"],
        }

    def build(self, weights: dict[str, np.ndarray], dtype: torch.dtype) -> HubRunner:
        layer = load_layer(self.layer_class(self.hub_config, layer_idx=0), weights, dtype, self.device)
        return HubRunner(layer, self.modeling, self.hub_config)


def _hub_config_fields(snapshot: Path, config: KDAConfig) -> dict[str, Any]:
    """The snapshot's config.json (if any) as a one-layer KDA model of `config`'s shape."""
    path = snapshot / CONFIG_JSON
    fields = json.loads(path.read_text()) if path.is_file() else {}
    linear = dict(fields.get("linear_attn_config") or {})
    linear.update(
        head_dim=config.head_dim,
        num_heads=config.num_heads,
        short_conv_kernel_size=config.conv_size,
        kda_layers=[1],
        full_attn_layers=[],
    )
    fields.update(
        hidden_size=config.hidden_size,
        rms_norm_eps=config.rms_norm_eps,
        num_hidden_layers=1,
        linear_attn_config=linear,
    )
    return fields


class HubRunner:
    def __init__(self, layer: torch.nn.Module, modeling: ModuleType, hub_config: Any):
        self.layer = layer
        self.modeling = modeling
        self.hub_config = hub_config

    def run(self, hidden: torch.Tensor, inputs: CaseInputs, initial_state: torch.Tensor | None) -> LayerRun:
        recorder = KernelRecorder()
        norms: list[NormCall] = []
        cache = self.modeling.KimiDynamicCache(self.hub_config)
        cache.recurrent_states[0] = initial_state
        kwargs = {}
        if inputs.packed:
            kwargs["cu_seqlens"] = torch.from_numpy(inputs.cu_seqlens).to(
                device=hidden.device, dtype=torch.long
            )
        with contextlib.ExitStack() as stack:
            for path, name in _KERNEL_FUNCTIONS.items():
                recording = recorder.wrap(path, getattr(self.modeling, name), _KERNEL_ARGS)
                stack.enter_context(replaced(self.modeling, name, recording))
            stack.enter_context(recording_norm(self.layer.o_norm, norms))
            out = self.layer(hidden[None], cache_params=cache, **kwargs)
        return assemble_run(out, recorder.calls, norms, len(inputs.spans))
