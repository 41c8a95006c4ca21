"""The `hf-hub` reference: the hub's `KimiDeltaAttention` from a downloaded snapshot, patched (RFC §6.1.5).

`--hub-snapshot DIR` is a local copy of the model's hub repository (`modeling_kimi.py`,
`configuration_kimi.py`, `config.json`); it cannot be fetched here and is never committed. The two files
import each other relatively, so the folder is imported as a package, with the transformers names that
moved since the file was written aliased for the import (`hub_compat`). The layer runs the packed batch
in one call, as a server does: `cu_seqlens` for the varlen cases, the initial states through its
`KimiDynamicCache`. It picks `fused_recurrent_kda` for 64 tokens or fewer and `chunk_kda` above, both
fla Triton kernels: on a GPU as they are, on a CPU under the Triton interpreter, with fla's naive chunk
kernel for `chunk_kda` (`hub_cpu`). Every difference from the stock file is in the manifest's `patches`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import io
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dump_gen.capture import (
    KernelRecorder,
    NormCall,
    gate_input_module,
    recording_norm,
    recording_output,
    replaced,
)
from dump_gen.errors import DumpError
from dump_gen.inputs import CaseInputs
from dump_gen.kernels import naive_chunk_kda_call
from dump_gen.references import hub_cpu
from dump_gen.references.base import LayerRun, assemble_run, device_description, load_layer, package_versions
from dump_gen.references.hub_compat import Alias, aliases_installed, imported_names, plan_aliases
from dump_gen.references.hub_patch import PATCH_NOTE, patch_layer_class
from dump_gen.references.layout import check_layout, module_layout
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


def import_snapshot(directory: str) -> tuple[ModuleType, ModuleType, list[Alias]]:
    """The snapshot's `modeling_kimi` and `configuration_kimi`, imported as submodules of one package, and
    the aliases of moved transformers names that their import needed."""
    root = Path(directory)
    for name in (MODELING_FILE, CONFIGURATION_FILE):
        if not (root / name).is_file():
            raise DumpError(
                f"--hub-snapshot {directory}: no {name} there (a download of the model's hub repository)"
            )
    aliases = plan_aliases(
        [*imported_names(root / MODELING_FILE), *imported_names(root / CONFIGURATION_FILE)]
    )
    # One package per snapshot folder and file content, so two snapshots never share modules.
    tag = hashlib.md5(f"{root.resolve()}:{file_md5(root / MODELING_FILE)}".encode()).hexdigest()[:16]
    package = f"_kimi_hub_snapshot_{tag}"
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(root)]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    try:
        # transformers' docstring checks print a line for each undocumented argument of the hub file's
        # model classes at import time: noise about code the dump never runs.
        with aliases_installed(aliases), contextlib.redirect_stdout(io.StringIO()):
            return (
                importlib.import_module(f"{package}.modeling_kimi"),
                importlib.import_module(f"{package}.configuration_kimi"),
                aliases,
            )
    except Exception as err:  # third-party code: any import failure is the user's environment
        raise DumpError(
            f"cannot import {root / MODELING_FILE}: {type(err).__name__}: {one_line(err)} "
            f"(installed: {package_versions()})"
        ) from None


def one_line(err: BaseException, limit: int = 300) -> str:
    """The first line of `err`'s message, at most `limit` characters."""
    lines = str(err).strip().splitlines() or [""]
    return lines[0][:limit]


def loud_warning(message: str) -> None:
    bar = "!" * 100
    print(f"{bar}\n!! WARNING: {message}\n{bar}", file=sys.stderr)


class HubReference:
    name = "hf-hub"

    def __init__(self, config: KDAConfig, device: str, snapshot: str):
        self.config = config
        self.device = device
        self.source = Path(snapshot) / MODELING_FILE
        # On a CPU, fla's Triton kernels must be imported under the interpreter (hub_cpu).
        with hub_cpu.triton_interpreter() if device == "cpu" else contextlib.nullcontext():
            self.modeling, configuration, self.aliases = import_snapshot(snapshot)
            from fla.ops.kda.gate import fused_kda_gate
        self.md5 = file_md5(self.source)
        if self.md5 != RFC_MODELING_MD5:
            loud_warning(
                f"{self.source} has md5 {self.md5}, not the RFC's pinned "
                f"{RFC_MODELING_MD5}: another revision of the hub file. The manifest records the md5 used."
            )
        self.layer_class = patch_layer_class(self.modeling, fused_kda_gate)
        self.hub_config = configuration.KimiLinearConfig(**_hub_config_fields(Path(snapshot), config))
        chunk = naive_chunk_kda_call if device == "cpu" else self.modeling.chunk_kda
        self.kernels = {"chunk": chunk, "fused_recurrent": self.modeling.fused_recurrent_kda}

    def describe(self) -> dict[str, Any]:
        patches = [f"{PATCH_NOTE}; current gate: fla.ops.kda.gate.fused_kda_gate"]
        patches += [alias.note() for alias in self.aliases]
        if self.device == "cpu":
            patches += hub_cpu.cpu_patches()
        return {
            "versions": package_versions(),
            "device": device_description(self.device),
            "modeling_file_md5": self.md5,
            "patches": patches,
        }

    def build(self, weights: dict[str, np.ndarray], dtype: torch.dtype) -> HubRunner:
        layer = self.layer_class(self.hub_config, layer_idx=0)
        check_layout(self.name, module_layout(layer), self.config)
        layer = load_layer(layer, weights, dtype, self.device, self.config.kda_family.fp32_weights)
        return HubRunner(self, layer)


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
    def __init__(self, reference: HubReference, layer: torch.nn.Module):
        self.reference = reference
        self.layer = layer

    def run(self, hidden: torch.Tensor, inputs: CaseInputs, initial_state: torch.Tensor | None) -> LayerRun:
        reference, modeling = self.reference, self.reference.modeling
        recorder = KernelRecorder()
        norms: list[NormCall] = []
        gate_inputs: list[torch.Tensor] = []
        cache = modeling.KimiDynamicCache(reference.hub_config)
        cache.recurrent_states[0] = initial_state
        kwargs = {}
        if inputs.packed:
            kwargs["cu_seqlens"] = torch.from_numpy(inputs.cu_seqlens).to(
                device=hidden.device, dtype=torch.long
            )
        with contextlib.ExitStack() as stack:
            if reference.device == "cpu":
                stack.enter_context(hub_cpu.interpreted_run())
            for path, kernel in reference.kernels.items():
                recording = recorder.wrap(path, kernel, _KERNEL_ARGS)
                stack.enter_context(replaced(modeling, _KERNEL_FUNCTIONS[path], recording))
            stack.enter_context(recording_norm(self.layer.o_norm, norms))
            gate_input = gate_input_module(reference.config.kda_family)
            stack.enter_context(recording_output(self.layer, gate_input, gate_inputs))
            try:
                out = self.layer(hidden[None], cache_params=cache, **kwargs)
            except Exception as err:  # the hub's code and fla's kernels: any failure ends the dump
                raise DumpError(
                    f"the hub layer ({reference.source}, {reference.device}, {hidden.dtype}) failed on "
                    f"{hidden.shape[0]} tokens in {len(inputs.spans)} sequence(s): "
                    f"{type(err).__name__}: {one_line(err)}"
                ) from None
        return assemble_run(out, recorder.calls, norms, len(inputs.spans), gate_inputs=gate_inputs)
