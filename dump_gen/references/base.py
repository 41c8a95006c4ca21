"""What every reference gives the generator, and the pieces the references share."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import torch

from dump_gen.capture import KERNEL_INPUTS, KernelCall, NormCall
from dump_gen.inputs import CaseInputs
from kda_spec.dump_format import GATE_INPUT_KEY
from kda_spec.extras import installed_versions

_VERSIONED = ("torch", "transformers", "fla-core", "flash-linear-attention", "triton", "numpy")


@dataclasses.dataclass
class LayerRun:
    """What a reference layer computed for one packed batch of T tokens."""

    out: torch.Tensor  # [T, hidden]
    intermediates: dict[str, torch.Tensor]  # dump names: [T, H, D] (g_raw in the run's dtype), beta [T, H]
    kernel_inputs: dict[str, torch.Tensor]  # q, k, v, g [1, T, H, D], beta [1, T, H], as passed to its kernel
    kernel_paths: list[str]  # the kernel the layer took for each sequence


class LayerRunner(Protocol):
    def run(self, hidden: torch.Tensor, inputs: CaseInputs, initial_state: torch.Tensor | None) -> LayerRun:
        """hidden: [T, hidden] in the run's dtype; initial_state: [N, H, D, D] float32 or None."""


class LayerBackward(Protocol):
    def vjp(
        self,
        hidden: torch.Tensor,
        inputs: CaseInputs,
        initial_state: torch.Tensor | None,
        dout: torch.Tensor,
        dht: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The layer's gradients under torch autograd (`TransformersRunner.vjp`): of the hidden states, the
        initial states and every weight, by `kda_spec.layer_vjp`'s names. A runner without it writes no
        gradients."""


class Reference(Protocol):
    name: str

    def describe(self) -> dict[str, Any]:
        """The manifest's `reference` block, less `name`: versions, device, patches, ..."""

    def build(self, weights: dict[str, np.ndarray], dtype: torch.dtype) -> LayerRunner:
        """The layer with these float32 HF-named weights, cast to `dtype` (A_log and dt_bias stay fp32)."""


def package_versions() -> dict[str, str]:
    """Versions of the packages a reference runs on (those installed), and CUDA's where there is one."""
    versions = installed_versions(_VERSIONED)
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions


def device_description(device: str) -> str:
    return f"cuda: {torch.cuda.get_device_name()}" if device == "cuda" else "cpu"


def load_layer(
    module: torch.nn.Module,
    state_dict: dict[str, np.ndarray],
    dtype: torch.dtype,
    device: str,
    fp32_parameters: frozenset[str],
) -> torch.nn.Module:
    """`module` on `device` in `dtype` holding `state_dict`, in eval mode; its parameters named in
    `fp32_parameters` (the family's fp32 weights under the module's names) stay float32.

    The float32 masters are copied into the cast parameters, so each value is rounded once.
    """
    module.to(device=device, dtype=dtype)
    for name, parameter in module.named_parameters():
        if name in fp32_parameters:
            parameter.data = parameter.data.float()
    module.load_state_dict({name: torch.from_numpy(array) for name, array in state_dict.items()}, strict=True)
    return module.eval()


def assemble_run(
    out: torch.Tensor,
    calls: list[KernelCall],
    norms: list[NormCall],
    num_seqs: int,
    *,
    gate_inputs: list[torch.Tensor],
) -> LayerRun:
    """A LayerRun from the layer's output [1, T, hidden] and its calls: one per sequence, or one in all;
    `gate_inputs`: the output [1, T, P] of the gate's input projection at each of them
    (`capture.recording_output` on `capture.gate_input_module`), the dump's `g_raw`."""
    if len(calls) not in (1, num_seqs) or len(norms) != len(calls) or len(gate_inputs) != len(calls):
        raise RuntimeError(
            f"the reference layer made {len(calls)} kernel, {len(norms)} norm and {len(gate_inputs)} gate "
            f"input calls for {num_seqs} sequences"
        )
    inputs = {name: torch.cat([call.inputs[name] for call in calls], dim=1) for name in KERNEL_INPUTS}
    paths = [call.path for call in calls] if len(calls) == num_seqs else [calls[0].path] * num_seqs
    intermediates = {
        "q_after_conv": inputs["q"][0],
        "k_after_conv": inputs["k"][0],
        "v_after_conv": inputs["v"][0],
        "g": inputs["g"][0],
        GATE_INPUT_KEY: torch.cat(gate_inputs, dim=1)[0].reshape(inputs["g"][0].shape),
        "beta": inputs["beta"][0],
        "g_out": torch.cat([norm.gate for norm in norms], dim=1)[0],
        "o_norm": torch.cat([norm.output for norm in norms], dim=1)[0],
    }
    return LayerRun(out[0], intermediates, inputs, paths)
