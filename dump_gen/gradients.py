"""The reference's gradients of one case in one run, under torch autograd: what the gradient checks judge an
implementation's backward against (docs/gradients.md, kda_spec.gradients for the keys).

- The chunk kernel's: on the run's own dumped q, k, v, g, beta (q and k l2-normalised in fp32 as the checker
  feeds a kernel, v as fp32 values), from the case's initial states (zeros where it has none), for the
  case's kernel cotangents: the gradients of `sum(o * do) + sum(final_state * dht)` w.r.t. each, by the
  kernel backend's `VJP_PATH` (fla's Triton chunk kernel on a GPU, its torch token recurrence on a CPU).
- The layer's: `runner.vjp` (the reference layer under autograd) for the case's layer cotangents, by
  `kda_spec.gradients.layer_gradient_results` name.

Both stored with their cotangents, as float32 (bf16 values as raw bits where the run held them in bf16).
"""

from __future__ import annotations

import numpy as np
import torch

from dump_gen.inputs import CaseInputs
from dump_gen.kernels import KernelBackend, KernelCall
from dump_gen.references.base import LayerBackward
from kda_spec.config import KDAConfig
from kda_spec.dump_format import FP32_IN_BF16_RUN, float32_to_bf16_bits
from kda_spec.gradients import kernel_cotangents, layer_cotangents, layer_gradient_results
from kda_spec.truth import GRADIENT_NAMES, l2_normalised

# The dumped stages a kernel's gradients are taken at, in the kernel's argument order.
KERNEL_STAGES = ("q_after_conv", "k_after_conv", "v_after_conv", "g", "beta")


def gradient_arrays(
    runner: LayerBackward,  # the reference layer of the run
    kernels: KernelBackend,
    inputs: CaseInputs,
    stages: dict[str, torch.Tensor],  # the run's results by dump name (`KERNEL_STAGES` among them)
    hidden: torch.Tensor,  # [T, hidden] in the run's dtype
    case_id: str,
    dtype: str,
    config: KDAConfig,
) -> dict[str, np.ndarray]:
    """The gradient keys of one run (`kda_spec.gradients.GRADIENT_KEYS`, without the run's suffix) as
    stored: the cotangents, the chunk kernel's and the layer's gradients."""
    tokens, num_seqs = hidden.shape[0], len(inputs.spans)
    do, dht = kernel_cotangents(case_id, dtype, tokens, num_seqs, config)
    dout, layer_dht = layer_cotangents(case_id, dtype, tokens, num_seqs, config)
    device = hidden.device
    kernel = kernel_gradients(kernels, inputs, stages, do, dht, device)
    state = None if inputs.initial_state is None else torch.from_numpy(inputs.initial_state).to(device)
    layer = runner.vjp(
        hidden, inputs, state, torch.from_numpy(dout).to(device), torch.from_numpy(layer_dht).to(device)
    )
    layer_results = layer_gradient_results({name: g.numpy() for name, g in layer.items()}, config)
    arrays = {
        "grad_chunk_do": do,
        "grad_chunk_dht": dht,
        **{f"grad_chunk_{name}": grad for name, grad in kernel.items()},
        "grad_layer_dout": dout,
        "grad_layer_dht": layer_dht,
        **{f"grad_layer_{name}": grad for name, grad in layer_results.items()},
    }
    return {name: stored_gradient(name, array, dtype) for name, array in arrays.items()}


def kernel_gradients(
    kernels: KernelBackend,
    inputs: CaseInputs,
    stages: dict[str, torch.Tensor],
    do: np.ndarray,  # [T, H, D]
    dht: np.ndarray,  # [N, H, D, D]
    device: torch.device,
) -> dict[str, np.ndarray]:
    """The reference kernel's gradients (`GRADIENT_NAMES`, float32) on the run's dumped kernel inputs."""
    q, k, v, g, beta = (stages[name].detach().float().cpu().numpy() for name in KERNEL_STAGES)
    init = inputs.initial_state
    if init is None:
        init = np.zeros(dht.shape, np.float32)
    arrays = (l2_normalised(q), l2_normalised(k), v, g, beta, init)
    leaves = [torch.from_numpy(np.ascontiguousarray(a)).to(device).requires_grad_() for a in arrays]
    per_token = [leaf[None] for leaf in leaves[:5]]
    call = KernelCall(
        *per_token, spans=inputs.spans, packed=inputs.packed, initial_state=leaves[5], normalized=True
    )
    with torch.enable_grad():
        result = kernels.run(kernels.VJP_PATH, call)
        loss = (result.o[0].float() * torch.from_numpy(do).to(device)).sum()
        loss = loss + (result.final_state.float() * torch.from_numpy(dht).to(device)).sum()
        grads = torch.autograd.grad(loss, leaves)
    return {name: grad.detach().float().cpu().numpy() for name, grad in zip(GRADIENT_NAMES, grads)}


def stored_gradient(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """Gradient key `name` of the `dtype` run as stored: raw bf16 bits where the bf16 run held it in bf16
    (every value bf16-representable; the fp32 keys `FP32_IN_BF16_RUN` never), float32 otherwise."""
    values = np.ascontiguousarray(array, np.float32)
    if dtype == "bf16" and name not in FP32_IN_BF16_RUN and not np.any(values.view(np.uint32) & 0xFFFF):
        return float32_to_bf16_bits(values)
    return values
