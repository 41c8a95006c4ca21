"""fla's forward KDA functions, in fla's torch calling convention, computed by kda_impl's kernels.

Each adapter takes the arguments of its fla function (bound to fla's own signature, so positional calls
work as in fla), converts the torch tensors to JAX arrays (the same dtype: float16, bfloat16 and float32
exactly; float64 as float32, JAX runs without x64), calls the kda_impl kernel under `KERNEL` (`naive` or
`pallas`) and converts the results back to torch tensors (JAX's dtype: o in q's, h in k's, the states
fp32). Arguments of fla that only steer its torch/CUDA machinery are dropped after a check:
`cu_seqlens_cpu` (must equal `cu_seqlens`) and `disable_recompute` (memory of fla's backward). Options
kda_impl does not have (context parallelism, CUDA graphs, headwise beta, spec decoding) raise
`Unsupported`; so does a kernel that refuses an option by name (a TypeError "unexpected keyword
argument", as kda_impl's kernels before fla's options were added).

The outputs carry a torch autograd node whose backward gives zero gradients (`NoGradient`), so the tests'
`.backward()` calls run; their gradient checks are not run (see `plugin.py`).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

KERNEL = "naive"  # the kda_impl kernel choice the adapters call: 'naive' or 'pallas' (plugin.py sets it)
CHUNK_SIZE = 64  # fla's chunk_kda default (`kwargs.pop("chunk_size", 64)`); kda_impl's plain default is 32
# Arguments of fla's functions that only steer its torch machinery, with the value that changes nothing.
UNSUPPORTED_UNLESS = {
    "cp_context": None,
    "use_graph": False,
    "max_num_seqs": None,
    "num_accepted_tokens": None,
}


class Unsupported(Exception):
    """An fla option or calling form kda_impl does not have."""


class NoGradient(torch.autograd.Function):
    """Identity on kda_impl's outputs, attached to the inputs that require grad: a backward pass runs
    through it and gives them zero gradients (never checked: the plugin does not run gradient checks)."""

    @staticmethod
    def forward(ctx, outputs: tuple[torch.Tensor, ...], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*inputs)
        return tuple(x.clone() for x in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *(torch.zeros_like(x) for x in ctx.saved_tensors))


def to_jax(x: Any) -> Any:
    """A torch tensor as a JAX array of its dtype (float64 as float32); anything else unchanged."""
    import jax.numpy as jnp

    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().cpu()
    if x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        dtype = {torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}.get(x.dtype, jnp.float32)
        return jnp.asarray(x.float().numpy()).astype(dtype)
    if x.dtype == torch.float64:
        return jnp.asarray(x.numpy().astype(np.float32))
    return jnp.asarray(x.numpy())


TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def to_torch(x: Any) -> Any:
    """A JAX array as a torch tensor of its dtype; None unchanged."""
    if x is None:
        return None
    array = np.asarray(x)
    return torch.from_numpy(array.astype(np.float32)).to(TORCH_DTYPES[array.dtype.name])


def with_no_gradient(outputs: tuple[Any, ...], inputs: dict[str, Any]) -> tuple[Any, ...]:
    """`outputs` (torch tensors or None) attached by `NoGradient` to the inputs that require grad."""
    needing = [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
    present = [i for i, x in enumerate(outputs) if x is not None]
    if not needing or not torch.is_grad_enabled():
        return outputs
    attached = NoGradient.apply(tuple(outputs[i] for i in present), *needing)
    result = list(outputs)
    for i, tensor in zip(present, attached, strict=True):
        result[i] = tensor
    return tuple(result)


def bind(function: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, as fla's `function` binds them (its **kwargs merged in)."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.update(named.pop("kwargs", {}))
    return named


def check_supported(named: dict[str, Any]) -> None:
    """Unsupported unless every option kda_impl does not have is off (and drop them)."""
    for name, neutral in UNSUPPORTED_UNLESS.items():
        value = named.pop(name, neutral)
        if value is not neutral and value != neutral:
            raise Unsupported(f"fla's {name}={value!r} is not a kda_impl option")


def drop_torch_only(named: dict[str, Any]) -> None:
    """Drop `cu_seqlens_cpu` (checked equal to `cu_seqlens`) and `disable_recompute` (backward memory)."""
    cpu = named.pop("cu_seqlens_cpu", None)
    if cpu is not None and not torch.equal(cpu.cpu(), named["cu_seqlens"].cpu()):
        raise ValueError("cu_seqlens_cpu differs from cu_seqlens")
    named.pop("disable_recompute", None)


def call_kernel(name: str, named: dict[str, Any], defaults: dict[str, Any]) -> Any:
    """`kda_impl.kernels.<name>` under `KERNEL` on `named`, the arguments equal to fla's `defaults`
    dropped (so a kernel without an option runs while the option is off); a TypeError naming an
    unexpected keyword is `Unsupported`."""
    from kda_impl import kernels

    tensors = ("q", "k", "v", "g", "beta")
    options = {
        key: to_jax(value)
        for key, value in named.items()
        if key not in tensors and not (key in defaults and _is_default(value, defaults[key]))
    }
    try:
        return getattr(kernels, name)(*(to_jax(named[t]) for t in tensors), kernel=KERNEL, **options)
    except TypeError as err:
        if "unexpected keyword argument" in str(err):
            raise Unsupported(f"kda_impl {name}: {err}") from err
        raise


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def _fla_defaults(function: Any) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def chunk_kda(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """fla's `chunk_kda` (forward) by kda_impl's `chunk_kda`."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    named = bind(fla_chunk_kda, args, kwargs)
    check_supported(named)
    drop_torch_only(named)
    named.setdefault("chunk_size", CHUNK_SIZE)
    result = call_kernel("chunk_kda", named, {**_fla_defaults(fla_chunk_kda), "A_log": None, "dt_bias": None})
    return with_no_gradient(tuple(to_torch(x) for x in result), named)


def fused_recurrent_kda(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """fla's `fused_recurrent_kda` by kda_impl's `fused_recurrent_kda`."""
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    named = bind(fla_fused_recurrent_kda, args, kwargs)
    check_supported(named)
    result = call_kernel("fused_recurrent_kda", named, _fla_defaults(fla_fused_recurrent_kda))
    return with_no_gradient(tuple(to_torch(x) for x in result), named)


def fused_recurrent_kda_fwd(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """fla's `fused_recurrent_kda_fwd` in its vLLM form (one token per sequence, states read from and
    written in place to the pool `initial_state` at `ssm_state_indices`) by kda_impl's
    `decode_kda_slots`; the pool tensor is updated in place, as fla's kernel does."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd

    named = bind(fla_fwd, args, kwargs)
    check_supported(named)
    indices, pool = named.pop("ssm_state_indices"), named.pop("initial_state")
    cu_seqlens = named.pop("cu_seqlens")
    if indices is None or not named.pop("inplace_final_state") or named.pop("out") is not None:
        raise Unsupported("fused_recurrent_kda_fwd is mapped only in its in-place slot-pool (vLLM) form")
    if indices.ndim != 1 or named["beta"].ndim == named["v"].ndim:
        raise Unsupported("speculative-decoding indices and headwise beta are not kda_impl options")
    tokens = named["q"].shape[1]
    one_each = cu_seqlens is not None and torch.equal(cu_seqlens.cpu().long(), torch.arange(tokens + 1))
    if not one_each:
        raise Unsupported("only one token per sequence (decode) is mapped")
    named.pop("output_final_state")
    named.update({t: named[t][0] for t in ("q", "k", "v", "g", "beta")})
    named.update(state_buffer=pool, slot_indices=indices.to(torch.int32))
    defaults = {**_fla_defaults(fla_fwd), "A_log": None, "dt_bias": None}
    o, new_pool = call_kernel("decode_kda_slots", named, defaults)
    pool.copy_(to_torch(new_pool))
    return to_torch(o)[None], pool


def fused_kda_gate(*args: Any, **kwargs: Any) -> Any:
    """fla's `fused_kda_gate` (forward, fp32 output) by `kda_impl.kernels.options.fla_gate`."""
    from fla.ops.kda.gate import fused_kda_gate as fla_fused_kda_gate

    from kda_impl.kernels import options

    named = bind(fla_fused_kda_gate, args, kwargs)
    if named.pop("output_dtype", torch.float32) != torch.float32:
        raise Unsupported("fused_kda_gate's output_dtype other than float32")
    if getattr(options, "fla_gate", None) is None:
        raise Unsupported("kda_impl has no fla_gate")
    gate = options.fla_gate(*(to_jax(named[n]) for n in ("g", "A_log", "dt_bias")), named["lower_bound"])
    return with_no_gradient((to_torch(gate),), named)[0]
