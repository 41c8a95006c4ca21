"""fla's KDA functions in fla's torch calling convention, by kda_impl's kernels (forward and backward).

Each adapter takes the arguments of its fla function (bound to fla's own signature, so positional calls
work as in fla), converts the torch tensors to JAX arrays (the same dtype: float16, bfloat16 and float32
exactly; float64 as float32, JAX runs without x64), calls the kda_impl kernel under `KERNEL` (`naive` or
`pallas`) and converts the results back to torch tensors (JAX's dtype: o in q's, h in k's, the states
fp32). Arguments of fla that only steer its torch/CUDA machinery are dropped after a check:
`cu_seqlens_cpu` (must equal `cu_seqlens`) and `disable_recompute` (memory of fla's backward). Options
kda_impl does not have (context parallelism, CUDA graphs, headwise beta, spec decoding) raise
`Unsupported`; so does a kernel that refuses an option by name (a TypeError "unexpected keyword
argument", as kda_impl's kernels before fla's options were added).

Gradients: when autograd is on and a float tensor argument requires grad, the outputs come from a torch
autograd node, `JaxBackward`: its forward runs the kda_impl call through `jax.vjp` with every float tensor
argument (q, k, v, g, beta, initial_state, A_log, dt_bias, ...) as a primal and keeps the pullback; its
backward converts torch's output gradients to JAX, applies the pullback and returns each input's
gradient in the input's dtype and device (float64 ones computed in float32, as the forward). The plain-JAX
kernels are differentiated by JAX's autodiff. The Pallas kernels have none: under `KERNEL = "pallas"` the
forward runs the Pallas kernel and the backward is that of the plain-JAX kernel on the same arguments
(`kernel="naive"`, its forward recomputed in the backward), so a gradient check judges the plain-JAX
kernels' backward under either choice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
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


# A kda_impl call: (the kernel choice, the float tensor arguments as JAX arrays by name) -> its outputs.
JaxCall = Callable[[str, dict[str, Any]], tuple[Any, ...]]
Outputs = tuple[torch.Tensor | None, ...]


class Unsupported(Exception):
    """An fla option or calling form kda_impl does not have."""


class JaxBackward(torch.autograd.Function):
    """A kda_impl call as a torch autograd node: `apply(call, kernel, names, *tensors)` returns
    `call(kernel, {name: tensor as JAX})`'s outputs as torch tensors, and its backward gives `tensors` the
    gradients of JAX's pullback (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, call: JaxCall, kernel: str, names: tuple[str, ...], *tensors: torch.Tensor
    ) -> Outputs:
        primals = {name: to_jax(tensor) for name, tensor in zip(names, tensors, strict=True)}
        outputs, ctx.pullback = outputs_and_pullback(call, kernel, primals)
        ctx.names = names
        ctx.output_dtypes = tuple(None if x is None else x.dtype for x in outputs)
        ctx.input_types = tuple((tensor.dtype, tensor.device) for tensor in tensors)
        return tuple(to_torch(x) for x in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        import jax.numpy as jnp

        cotangents = tuple(
            None if dtype is None else jnp.asarray(to_jax(grad), dtype)
            for grad, dtype in zip(grads, ctx.output_dtypes, strict=True)
        )
        (gradients,) = ctx.pullback(cotangents)
        inputs = zip(ctx.names, ctx.input_types, ctx.needs_input_grad[3:], strict=True)
        grads_in = (
            to_torch(gradients[name]).to(dtype=dtype, device=device) if need else None
            for name, (dtype, device), need in inputs
        )
        return (None, None, None, *grads_in)


def outputs_and_pullback(
    call: JaxCall, kernel: str, primals: dict[str, Any]
) -> tuple[tuple[Any, ...], Callable[[tuple[Any, ...]], tuple[dict[str, Any]]]]:
    """`call(kernel, primals)`'s outputs and the pullback of `call("naive", ...)` at `primals`: one
    `jax.vjp` for the plain-JAX kernels; for another kernel its own forward, the plain-JAX vjp computed
    when the pullback is applied."""
    import jax

    def naive(primals: dict[str, Any]) -> tuple[Any, ...]:
        return call("naive", primals)

    if kernel == "naive":
        return jax.vjp(naive, primals)
    return call(kernel, primals), lambda cotangents: jax.vjp(naive, primals)[1](cotangents)


def differentiable(call: JaxCall, kernel: str, floats: dict[str, torch.Tensor]) -> Outputs:
    """`call(kernel, floats as JAX)`'s outputs as torch tensors, through `JaxBackward` when autograd is on
    and one of `floats` requires grad."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in floats.values()):
        return JaxBackward.apply(call, kernel, tuple(floats), *floats.values())
    return tuple(to_torch(x) for x in call(kernel, {name: to_jax(x) for name, x in floats.items()}))


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


def call_kernel(name: str, named: dict[str, Any], defaults: dict[str, Any]) -> Outputs:
    """`kda_impl.kernels.<name>` under `KERNEL` on `named` (its float tensors differentiable, see
    `differentiable`), the arguments equal to fla's `defaults` dropped (so a kernel without an option runs
    while the option is off); a TypeError naming an unexpected keyword is `Unsupported`."""
    from kda_impl import kernels

    floats = {key: value for key, value in named.items() if _is_float_tensor(value)}
    options = {
        key: to_jax(value)
        for key, value in named.items()
        if key not in floats and not (key in defaults and _is_default(value, defaults[key]))
    }

    def call(kernel: str, primals: dict[str, Any]) -> tuple[Any, ...]:
        try:
            return tuple(getattr(kernels, name)(**primals, kernel=kernel, **options))
        except TypeError as err:
            if "unexpected keyword argument" in str(err):
                raise Unsupported(f"kda_impl {name}: {err}") from err
            raise

    return differentiable(call, KERNEL, floats)


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


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
    return call_kernel("chunk_kda", named, {**_fla_defaults(fla_chunk_kda), "A_log": None, "dt_bias": None})


def fused_recurrent_kda(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """fla's `fused_recurrent_kda` by kda_impl's `fused_recurrent_kda`."""
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    named = bind(fla_fused_recurrent_kda, args, kwargs)
    check_supported(named)
    return call_kernel("fused_recurrent_kda", named, _fla_defaults(fla_fused_recurrent_kda))


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
    pool.copy_(new_pool)
    return o[None], pool


def fused_kda_gate(*args: Any, **kwargs: Any) -> Any:
    """fla's `fused_kda_gate` (fp32 output) by `kda_impl.kernels.options.fla_gate`, plain JAX under either
    `KERNEL`; differentiable in g, A_log and dt_bias (`differentiable`)."""
    from fla.ops.kda.gate import fused_kda_gate as fla_fused_kda_gate

    from kda_impl.kernels import options

    named = bind(fla_fused_kda_gate, args, kwargs)
    if named.pop("output_dtype", torch.float32) != torch.float32:
        raise Unsupported("fused_kda_gate's output_dtype other than float32")
    if getattr(options, "fla_gate", None) is None:
        raise Unsupported("kda_impl has no fla_gate")
    floats = {name: named[name] for name in ("g", "A_log", "dt_bias") if named[name] is not None}

    def gate(kernel: str, primals: dict[str, Any]) -> tuple[Any]:
        return (
            options.fla_gate(
                primals["g"], primals.get("A_log"), primals.get("dt_bias"), named["lower_bound"]
            ),
        )

    return differentiable(gate, "naive", floats)[0]
