"""The `transformers` and `fla` references: transformers' `KimiLinearDeltaAttention`.

The layer has no varlen: each sequence of a packed case runs alone with batch 1, and the results are
concatenated. A sequence with an initial state runs from a cache holding that state and a zero conv
state, which is how the layer continues a sequence. For a prefill the layer calls its chunk kernel; for
a single token with a state, its recurrent one.

- `transformers`: the layer's kernel functions as transformers resolves them on a GPU (fla's Triton
  kernels when fla is installed), their pure-torch versions (`__wrapped__`) on a CPU.
- `fla`: the same layer with its kernel functions replaced by fla's: Triton `chunk_kda` /
  `fused_recurrent_kda` on a GPU, the torch references `naive_chunk_kda` / `naive_recurrent_kda` on a CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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
from dump_gen.inputs import CaseInputs
from dump_gen.kernels import PATHS, KernelBackend, KernelCall, kernel_backend
from dump_gen.references.base import LayerRun, assemble_run, device_description, load_layer, package_versions
from dump_gen.references.layout import check_layout, module_layout
from dump_gen.references.transformers_names import HF_TO_TRANSFORMERS, hf_to_transformers, transformers_to_hf
from kda_spec.config import KDAConfig

# The module-level kernel functions the layer's forward calls, by path; their names for q, k, v, g, beta.
_KERNEL_FUNCTIONS = {
    "chunk": "chunk_kimi_delta_attention",
    "fused_recurrent": "recurrent_kimi_delta_attention",
}
_KERNEL_ARGS = ("query", "key", "value", "g", "beta")


def _modeling() -> Any:
    from transformers.models.kimi_linear import modeling_kimi_linear

    return modeling_kimi_linear


def transformers_config(config: KDAConfig) -> Any:
    """A one-layer `KimiLinearConfig` whose only layer is a KDA layer of `config`'s shape."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    return KimiLinearConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=1,
        rms_norm_eps=config.rms_norm_eps,
        linear_attn_config={
            "head_dim": config.head_dim,
            "num_heads": config.num_heads,
            "short_conv_kernel_size": config.conv_size,
            "kda_layers": [1],
            "full_attn_layers": [],
        },
    )


class TransformersReference:
    name = "transformers"

    def __init__(self, config: KDAConfig, device: str):
        self.config = config
        self.device = device
        self.hf_config = transformers_config(config)

    def layer_kernels(self) -> dict[str, Callable[..., Any]]:
        """The function the layer runs for each kernel path."""
        modeling = _modeling()
        functions = {path: getattr(modeling, name) for path, name in _KERNEL_FUNCTIONS.items()}
        if self.device == "cpu":
            return {path: function.__wrapped__ for path, function in functions.items()}
        return functions

    def patches(self) -> list[str]:
        if self.device == "cpu":
            return [
                "chunk_kimi_delta_attention, recurrent_kimi_delta_attention: their pure-torch versions "
                "(__wrapped__), as fla's Triton kernels need a GPU"
            ]
        return []

    def describe(self) -> dict[str, Any]:
        return {
            "versions": package_versions(),
            "device": device_description(self.device),
            "patches": self.patches(),
        }

    def build(self, weights: dict[str, np.ndarray], dtype: torch.dtype) -> TransformersRunner:
        layer = _modeling().KimiLinearDeltaAttention(self.hf_config, layer_idx=0)
        check_layout(self.name, module_layout(layer, transformers_to_hf), self.config)
        kept = frozenset(HF_TO_TRANSFORMERS[name] for name in self.config.kda_family.fp32_weights)
        layer = load_layer(layer, hf_to_transformers(weights), dtype, self.device, kept)
        gate_input = gate_input_module(self.config.kda_family, HF_TO_TRANSFORMERS.__getitem__)
        return TransformersRunner(layer, self.hf_config, self.layer_kernels(), gate_input)


class FlaReference(TransformersReference):
    name = "fla"

    def __init__(self, config: KDAConfig, device: str):
        super().__init__(config, device)
        self.kernels = kernel_backend(device)

    def layer_kernels(self) -> dict[str, Callable[..., Any]]:
        return {path: _layer_call(self.kernels, path) for path in PATHS}

    def patches(self) -> list[str]:
        return [
            "chunk_kimi_delta_attention, recurrent_kimi_delta_attention: replaced by "
            f"{self.kernels.name} with use_qk_l2norm_in_kernel=True"
        ]


def _layer_call(kernels: KernelBackend, path: str) -> Callable[..., Any]:
    """`kernels`' `path` with the call shape of transformers' kernel functions (one sequence, batch 1)."""

    def kernel(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not use_qk_l2norm_in_kernel:
            raise RuntimeError(f"the layer called its {path} kernel without use_qk_l2norm_in_kernel")
        spans = [(0, query.shape[1])]  # one sequence
        call = KernelCall(query, key, value, g, beta, spans, packed=False, initial_state=initial_state)
        result = kernels.run(path, call)
        return result.o, result.final_state if output_final_state else None

    return kernel


class TransformersRunner:
    def __init__(
        self, layer: torch.nn.Module, hf_config: Any, kernels: dict[str, Callable[..., Any]], gate_input: str
    ):
        self.layer = layer
        self.hf_config = hf_config
        self.kernels = kernels
        self.gate_input = gate_input  # the submodule whose output is the raw gate

    def _cache(self, state: torch.Tensor) -> Any:
        """A cache from which the layer continues a sequence: recurrent `state` [1, H, D, D], conv zeros."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.hf_config)
        weight = self.layer.conv1d.weight
        zeros = torch.zeros(
            1, self.layer.conv_dim, self.layer.conv_kernel_size, dtype=weight.dtype, device=weight.device
        )
        cache.update_conv_state(zeros, layer_idx=0)
        cache.update_recurrent_state(state, layer_idx=0)
        return cache

    def run(self, hidden: torch.Tensor, inputs: CaseInputs, initial_state: torch.Tensor | None) -> LayerRun:
        recorder = KernelRecorder()
        norms: list[NormCall] = []
        gate_inputs: list[torch.Tensor] = []
        modeling = _modeling()
        outputs = []
        with contextlib.ExitStack() as stack:
            for path, function in self.kernels.items():
                recording = recorder.wrap(path, function, _KERNEL_ARGS)
                stack.enter_context(replaced(modeling, _KERNEL_FUNCTIONS[path], recording))
            stack.enter_context(recording_norm(self.layer.o_norm, norms))
            stack.enter_context(recording_output(self.layer, self.gate_input, gate_inputs))
            for index, (start, end) in enumerate(inputs.spans):
                cache = None if initial_state is None else self._cache(initial_state[index : index + 1])
                outputs.append(self.layer(hidden[None, start:end], cache=cache))
        return assemble_run(
            torch.cat(outputs, dim=1), recorder.calls, norms, len(inputs.spans), gate_inputs=gate_inputs
        )
