"""The `transformers` and `fla` references: transformers' KDA layer of the config's family,
`KimiLinearDeltaAttention` (kimi-linear) or `Glm5NextTextLinearAttention` (glm5-next)
(`transformers_families`).

The layer has no varlen: each sequence of a packed case runs alone with batch 1, and the results are
concatenated. A sequence with an initial state runs from a cache holding that state and a zero conv
state in the run's dtype, which is how the layer continues a sequence. For a prefill the layer calls its
chunk kernel; for a single token with a state, its recurrent one.

- `transformers`: the layer's kernel functions as transformers resolves them on a GPU (fla's Triton
  kernels when fla is installed), their pure-torch versions (`__wrapped__`) on a CPU.
- `fla`: the same layer with its kernel functions replaced by fla's: Triton `chunk_kda` /
  `fused_recurrent_kda` on a GPU, the torch references `naive_chunk_kda` / `naive_recurrent_kda` on a CPU;
  a lower-bound family's forget gate (after its projections) is fla's too: `fused_kda_gate` on a GPU,
  `naive_kda_lowerbound_gate` on a CPU, with the config's `lower_bound`.
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
from dump_gen.kernels import PATHS, KernelBackend, KernelCall, NaiveKernels, kernel_backend
from dump_gen.references.base import LayerRun, assemble_run, device_description, load_layer, package_versions
from dump_gen.references.layout import check_layout, module_layout
from dump_gen.references.transformers_families import TransformersLayer, transformers_layer
from kda_spec.config import KDAConfig

# The module-level kernel functions the layer's forward calls, by path; their names for q, k, v, g, beta.
_KERNEL_FUNCTIONS = {
    "chunk": "chunk_kimi_delta_attention",
    "fused_recurrent": "recurrent_kimi_delta_attention",
}
_KERNEL_ARGS = ("query", "key", "value", "g", "beta")

# A forget gate's replacement: the gate submodule's forward, given the submodule.
GateForward = Callable[[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor]]


class TransformersReference:
    name = "transformers"

    def __init__(self, config: KDAConfig, device: str):
        self.config = config
        self.device = device
        self.layer = transformers_layer(config)
        self.hf_config = self.layer.make_config(config)

    def layer_kernels(self) -> dict[str, Callable[..., Any]]:
        """The function the layer runs for each kernel path."""
        modeling = self.layer.modeling()
        functions = {path: getattr(modeling, name) for path, name in _KERNEL_FUNCTIONS.items()}
        if self.device == "cpu":
            return {path: function.__wrapped__ for path, function in functions.items()}
        return functions

    def gradient_kernels(self) -> dict[str, Callable[..., Any]]:
        """The function the layer's backward run (`TransformersRunner.vjp`) calls for each kernel path: the
        layer's own where they have a backward (fla's Triton kernels on a GPU); on a CPU fla's torch token
        recurrence for both (`NaiveKernels.VJP_PATH`), as transformers' pure-torch kernels write in place
        into tensors autograd keeps."""
        if self.device == "cpu":
            return {path: _layer_call(NaiveKernels(), NaiveKernels.VJP_PATH) for path in PATHS}
        return self.layer_kernels()

    def gate_forward(self) -> GateForward | None:
        """What replaces the layer's forget gate's forward (None: the layer's own gate runs)."""
        return None

    def patches(self) -> list[str]:
        if self.device == "cpu":
            return [
                "chunk_kimi_delta_attention, recurrent_kimi_delta_attention: their pure-torch versions "
                "(__wrapped__), as fla's Triton kernels need a GPU",
                f"the layer's gradients: its kernel functions {NaiveKernels.VJP_NAME} under torch autograd, "
                "as the pure-torch versions write in place into tensors autograd keeps",
            ]
        return []

    def describe(self) -> dict[str, Any]:
        return {
            "versions": package_versions(),
            "device": device_description(self.device),
            "layer": self.config.kda_family.reference,
            "patches": self.patches(),
        }

    def build(self, weights: dict[str, np.ndarray], dtype: torch.dtype) -> TransformersRunner:
        """`weights`: the family's checkpoint names (kda_spec.weight_names), float32."""
        spec = self.layer
        layer = getattr(spec.modeling(), spec.layer_class)(self.hf_config, layer_idx=0)
        check_layout(self.name, module_layout(layer, spec.from_module), self.config)
        kept = spec.module_names(self.config.kda_family.fp32_weights)
        layer = load_layer(layer, spec.to_module(weights), dtype, self.device, kept)
        gate_input = gate_input_module(self.config.kda_family, spec.module_name)
        return TransformersRunner(
            layer, spec, self.hf_config, self.layer_kernels(), gate_input, self.gate_forward(),
            self.gradient_kernels(),
        )  # fmt: skip


class FlaReference(TransformersReference):
    name = "fla"

    def __init__(self, config: KDAConfig, device: str):
        super().__init__(config, device)
        self.kernels = kernel_backend(device, config)

    def layer_kernels(self) -> dict[str, Callable[..., Any]]:
        return {path: _layer_call(self.kernels, path) for path in PATHS}

    def gradient_kernels(self) -> dict[str, Callable[..., Any]]:
        if self.device == "cpu":  # the backward of fla's torch token recurrence (NaiveKernels.VJP_PATH)
            return {path: _layer_call(self.kernels, NaiveKernels.VJP_PATH) for path in PATHS}
        return self.layer_kernels()  # fla's Triton kernels have a backward

    def _gate_function(self) -> tuple[str, Callable[..., torch.Tensor]]:
        """fla's lower-bound gate on this device, and its name."""
        if self.device == "cpu":
            from fla.ops.kda.gate import naive_kda_lowerbound_gate

            return "fla.ops.kda.gate.naive_kda_lowerbound_gate", naive_kda_lowerbound_gate
        from fla.ops.kda.gate import fused_kda_gate

        return "fla.ops.kda.gate.fused_kda_gate", fused_kda_gate

    def gate_forward(self) -> GateForward | None:
        if not self.config.kda_family.lower_bound_gate:
            return None
        _, function = self._gate_function()
        return _fla_lower_bound_gate(function, self.config)

    def patches(self) -> list[str]:
        patches = [
            "chunk_kimi_delta_attention, recurrent_kimi_delta_attention: replaced by "
            f"{self.kernels.name} with use_qk_l2norm_in_kernel=True"
        ]
        if self.config.kda_family.lower_bound_gate:
            name, _ = self._gate_function()
            patches.append(
                f"forget_gate: its projections, then {name}(f, A_log, dt_bias, "
                f"lower_bound={self.config.gate_lower_bound}) in fp32"
            )
        return patches


def _fla_lower_bound_gate(function: Callable[..., torch.Tensor], config: KDAConfig) -> GateForward:
    """The forward of a lower-bound forget gate module computed by fla's gate `function`: the module's own
    `f_b_proj(f_a_proj(x))`, then `L * sigmoid(exp(A_log) * (f + dt_bias))` in fp32 by `function`."""

    def forward_of(gate: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            """hidden_states: [B, T, hidden] -> g [B, T, H, D] float32."""
            f = gate.f_b_proj(gate.f_a_proj(hidden_states))
            f = f.view(*f.shape[:-1], config.num_heads, config.head_dim)
            return function(
                f, gate.A_log, gate.dt_bias, lower_bound=config.gate_lower_bound, output_dtype=torch.float32
            )

        return forward

    return forward_of


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
        self,
        layer: torch.nn.Module,
        spec: TransformersLayer,
        hf_config: Any,
        kernels: dict[str, Callable[..., Any]],
        gate_input: str,
        gate_forward: GateForward | None = None,
        gradient_kernels: dict[str, Callable[..., Any]] | None = None,
    ):
        self.layer = layer
        self.spec = spec
        self.hf_config = hf_config
        self.kernels = kernels
        self.gate_input = gate_input  # the submodule whose output is the raw gate
        self.gate_forward = gate_forward
        self.gradient_kernels = gradient_kernels or kernels  # the kernel functions of `vjp`

    def _cache(self, state: torch.Tensor, dtype: torch.dtype) -> Any:
        """A cache from which the layer continues a sequence: recurrent `state` [1, H, D, D], conv zeros in
        the run's `dtype` (the dtype a cache's conv state takes from the layer's first q|k|v)."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.hf_config)
        weight = self.layer.conv1d.weight
        zeros = torch.zeros(
            1, self.layer.conv_dim, self.layer.conv_kernel_size, dtype=dtype, device=weight.device
        )
        cache.update_conv_state(zeros, layer_idx=0)
        cache.update_recurrent_state(state, layer_idx=0)
        return cache

    def run(self, hidden: torch.Tensor, inputs: CaseInputs, initial_state: torch.Tensor | None) -> LayerRun:
        recorder = KernelRecorder()
        norms: list[NormCall] = []
        gate_inputs: list[torch.Tensor] = []
        modeling = self.spec.modeling()
        outputs = []
        with contextlib.ExitStack() as stack:
            for path, function in self.kernels.items():
                recording = recorder.wrap(path, function, _KERNEL_ARGS)
                stack.enter_context(replaced(modeling, _KERNEL_FUNCTIONS[path], recording))
            if self.gate_forward is not None:
                gate = self.layer.forget_gate
                stack.enter_context(replaced(gate, "forward", self.gate_forward(gate)))
            stack.enter_context(recording_norm(self.layer.o_norm, norms))
            stack.enter_context(recording_output(self.layer, self.gate_input, gate_inputs))
            for index, (start, end) in enumerate(inputs.spans):
                cache = (
                    None
                    if initial_state is None
                    else self._cache(initial_state[index : index + 1], hidden.dtype)
                )
                outputs.append(self.layer(hidden[None, start:end], cache=cache))
        return assemble_run(
            torch.cat(outputs, dim=1), recorder.calls, norms, len(inputs.spans), gate_inputs=gate_inputs
        )

    def vjp(
        self,
        hidden: torch.Tensor,  # [T, hidden] in the run's dtype
        inputs: CaseInputs,
        initial_state: torch.Tensor | None,  # [N, H, D, D] float32, or None: zeros
        dout: torch.Tensor,  # [T, hidden] float32
        dht: torch.Tensor,  # [N, H, D, D] float32
    ) -> dict[str, torch.Tensor]:
        """The layer's backward under torch autograd: the gradients of `sum(out * dout) + sum(final_states *
        dht)` for one prefill of the case's sequences, each from its initial state (zeros when None) and a
        zero conv state, with respect to the hidden states, the initial states and every parameter, by
        `kda_spec.layer_vjp`'s names (`hidden_states`, `initial_state`, the family's HF weight names), as
        float32 tensors of the run's values. Each sequence runs alone (batch 1) through the layer, its kernel
        functions `gradient_kernels`, each kernel call given the sequence's initial state and asked for its
        final state."""
        x = hidden.detach().requires_grad_()
        if initial_state is None:
            initial_state = torch.zeros_like(dht)
        h0 = initial_state.detach().float().requires_grad_()
        parameters = dict(self.layer.named_parameters())
        modeling = self.spec.modeling()
        loss = torch.zeros((), device=hidden.device)
        with contextlib.ExitStack() as stack:
            if self.gate_forward is not None:
                stack.enter_context(
                    replaced(self.layer.forget_gate, "forward", self.gate_forward(self.layer.forget_gate))
                )
            for index, (start, end) in enumerate(inputs.spans):
                finals: list[torch.Tensor] = []
                with contextlib.ExitStack() as calls:
                    for path, function in self.gradient_kernels.items():
                        from_state = _from_state(function, h0[index : index + 1], finals)
                        calls.enter_context(replaced(modeling, _KERNEL_FUNCTIONS[path], from_state))
                    out = self.layer(x[None, start:end])[0]
                (final,) = finals
                loss = (
                    loss
                    + (out.float() * dout[start:end]).sum()
                    + (final.float() * dht[index : index + 1]).sum()
                )
        grads = torch.autograd.grad(loss, [x, h0, *parameters.values()], allow_unused=True)
        named = {
            name: torch.zeros_like(p) if grad is None else grad
            for (name, p), grad in zip(parameters.items(), grads[2:])
        }
        weights = self.spec.from_module(
            {name: grad.detach().float().cpu().numpy() for name, grad in named.items()}
        )
        return {
            **{name: torch.from_numpy(array) for name, array in weights.items()},
            "hidden_states": grads[0].detach().float().cpu(),
            "initial_state": grads[1].detach().float().cpu(),
        }


def _from_state(
    function: Callable[..., Any], state: torch.Tensor, finals: list[torch.Tensor]
) -> Callable[..., Any]:
    """Kernel `function` called with `initial_state=state` and `output_final_state=True`, whatever the layer
    passed, its final state appended to `finals`; the layer gets the output and no state (it has no cache)."""

    def kernel(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        o, final = function(*args, **{**kwargs, "initial_state": state, "output_final_state": True})
        finals.append(final)
        return o, None

    return kernel
