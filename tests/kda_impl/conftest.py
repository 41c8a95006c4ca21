"""Shared pieces of the kda_impl tests: configs, realistic random weights, a serving-path runner, the
transformers reference layer, and the seed that replays a failed test in its report.

Compilation dominates the run time on a CPU, so the runners are built once per (config, dtype) and every
batch is padded to one token bucket (`TOKEN_BUCKET`): each runner compiles one EXTEND and one DECODE step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from dump_gen.references.transformers_names import hf_to_transformers
from kda_impl.layers.attention.linear.kda_backend import KDAAttnBackend
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch, pad_rows
from kda_impl.models.kimi_linear import jit_forward
from kda_impl.weights import layer_from_hf_weights
from kda_spec.config import KDAConfig, get_preset
from kda_spec.synthetic_weights import synthetic_weights
from tests.kda_impl.kernel_inputs import SEED_ENV, seeded_rng

TOKEN_BUCKET = 256  # every test batch has at most this many tokens
NUM_SLOTS = 16

CONFIGS = {
    "mini": get_preset("mini"),
    # The real head shape (D = 128) with a few heads and an odd head count.
    "d128": KDAConfig(hidden_size=256, num_heads=3, head_dim=128, preset="d128", kda_layers=(1,)),
    "glm5-next-mini": get_preset("glm5-next-mini"),
    # The lower-bound family at another floor, the real head shape and an odd head count.
    "glm-d128": KDAConfig(
        hidden_size=256,
        num_heads=3,
        head_dim=128,
        preset="glm-d128",
        kda_layers=(1,),
        family="glm5-next",
        gate_lower_bound=-3.0,
    ),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def random_tokens(rng: np.random.Generator, config: KDAConfig, tokens: int) -> np.ndarray:
    """[tokens, hidden] float32 hidden states."""
    return rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)


def random_states(rng: np.random.Generator, config: KDAConfig, num_seqs: int) -> np.ndarray:
    """[N, H, D, D] float32 recurrent states of the magnitude a prefill leaves behind."""
    shape = (num_seqs, config.num_heads, config.head_dim, config.head_dim)
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Element-wise `|a - b| <= atol + rtol * |b|`, reporting the worst element."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), "non-finite values"
    excess = np.abs(actual - expected) - (atol + rtol * np.abs(expected))
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (
        f"{np.mean(excess > 0):.2%} of elements outside atol={atol}, rtol={rtol}; worst at {worst}: "
        f"{actual[worst]} vs {expected[worst]}"
    )


@dataclasses.dataclass
class Step:
    """Per-request results of one runner step (float32 numpy, padding removed)."""

    outs: list[np.ndarray]  # [T_i, hidden] each
    intermediates: dict[str, np.ndarray]  # dump name -> [T_real, ...]


class LayerRunner:
    """One KDA layer served the real way: module + pool + backend, a jitted forward with the pool donated."""

    def __init__(self, config: KDAConfig, weights: dict[str, np.ndarray], dtype: Any):
        self.config = config
        self.dtype = dtype
        self.module = layer_from_hf_weights(config, 0, weights, dtype)
        self.pool = RecurrentStatePool.create(config, NUM_SLOTS, dtype, layer_ids=(0,))
        self.backend = KDAAttnBackend()
        self.forward = jit_forward(self.module, return_intermediates=True)
        self.allocated: set[int] = set()

    def alloc(self, n: int) -> list[int]:
        slots = self.pool.alloc(n).tolist()
        self.allocated.update(slots)
        return slots

    def free(self, slots: Sequence[int]) -> None:
        self.pool.free(slots)
        self.allocated.difference_update(slots)

    def batch(self, mode: ForwardMode, seq_lens: Sequence[int], slots: Sequence[int]) -> ForwardBatch:
        indices = self.pool.get_recurrent_indices(slots)
        return make_forward_batch(
            self.backend, mode, seq_lens, indices, num_slots=self.pool.num_slots, min_tokens=TOKEN_BUCKET
        )

    def run(self, batch: ForwardBatch, xs: Sequence[np.ndarray]) -> Step:
        lens = [len(x) for x in xs]
        hidden = jnp.asarray(pad_rows(np.concatenate(xs), batch.num_tokens), self.dtype)
        out, self.pool, intermediates = self.forward(hidden, batch, self.pool)
        real = sum(lens)
        out = np.asarray(out[:real].astype(jnp.float32))
        named = {name: np.asarray(value[:real].astype(jnp.float32)) for name, value in intermediates.items()}
        return Step(np.split(out, np.cumsum(lens)[:-1]), named)

    def extend(self, xs: Sequence[np.ndarray], slots: Sequence[int]) -> Step:
        return self.run(self.batch(ForwardMode.EXTEND, [len(x) for x in xs], slots), xs)

    def decode(self, tokens: np.ndarray, slots: Sequence[int]) -> np.ndarray:
        """One token per request: tokens `[N, hidden]` → outputs `[N, hidden]`."""
        step = self.run(self.batch(ForwardMode.DECODE, [1] * len(slots), slots), list(tokens[:, None]))
        return np.concatenate(step.outs)

    def states(self, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(recurrent [N, H, D, D], conv [N, W-1, 3, P]) of `slots`, float32."""
        recurrent, conv = self.pool.get_linear_recurrent_layer_cache(0)
        index = np.asarray(slots)
        return np.asarray(recurrent[index]), np.asarray(conv[index].astype(jnp.float32))

    def write_recurrent(self, slots: Sequence[int], recurrent: np.ndarray) -> None:
        """Put recurrent states `[N, H, D, D]` into `slots` (conv states zero)."""
        conv = jnp.zeros((len(slots), self.config.conv_size - 1, 3, self.config.proj_dim), self.dtype)
        self.pool = self.pool.set_linear_recurrent_layer_cache(
            0, jnp.asarray(slots, jnp.int32), jnp.asarray(recurrent), conv
        )

    def release(self) -> None:
        self.free(sorted(self.allocated))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test that drew seeded inputs (`kernel_inputs.seeded_rng`) names the seed that replays it."""
    outcome = yield
    report = outcome.get_result()
    seeds = [value for name, value in item.user_properties if name == SEED_ENV]
    if report.failed and seeds:
        report.sections.append((SEED_ENV, f"replay with {SEED_ENV}={seeds[0]} (and the same test id)"))


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """The test's seeded generator (`kernel_inputs.seeded_rng`)."""
    return seeded_rng(request)


@pytest.fixture
def fla() -> Any:
    """fla-core's naive torch kernels (`kernel_inputs.fla_reference` uses them); skips without them."""
    pytest.importorskip("torch")
    return pytest.importorskip("fla.ops.kda.naive")


@pytest.fixture(scope="session")
def _runner_cache() -> dict[tuple[str, str], LayerRunner]:
    return {}


@pytest.fixture
def runner_for(_runner_cache: dict) -> Iterator[Callable[[str, str], LayerRunner]]:
    """`runner_for(config_name, dtype_name)`: the shared runner (weights seed 0); slots freed afterwards."""
    used: list[LayerRunner] = []

    def get(config_name: str, dtype_name: str = "fp32") -> LayerRunner:
        key = (config_name, dtype_name)
        if key not in _runner_cache:
            config = CONFIGS[config_name]
            _runner_cache[key] = LayerRunner(config, synthetic_weights(config, seed=0), DTYPES[dtype_name])
        used.append(_runner_cache[key])
        return _runner_cache[key]

    yield get
    for runner in used:
        runner.release()


# --- the transformers reference --------------------------------------------------------------------------


class TorchReference:
    """transformers' `KimiLinearDeltaAttention` with the same weights, on its pure-torch kernels.

    transformers routes its kernels to fla's Triton code when fla is installed, which needs a GPU; the
    pure-torch functions are the `__wrapped__` of the module-level functions, patched in by
    `torch_reference`. The chunk function is wrapped once more so that a test can give the initial
    recurrent state and read the final one (the layer exposes neither without a cache).
    """

    def __init__(self, config: KDAConfig, weights: dict[str, np.ndarray], dtype_name: str, chunk_hook: Any):
        import torch
        from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

        self.torch = torch
        hf_config = KimiLinearConfig(
            hidden_size=config.hidden_size,
            linear_num_heads=config.num_heads,
            linear_head_dim=config.head_dim,
            linear_conv_kernel_dim=config.conv_size,
            rms_norm_eps=config.rms_norm_eps,
            num_hidden_layers=1,
            layer_types=["linear_attention"],
        )
        layer = KimiLinearDeltaAttention(hf_config, layer_idx=0)
        layer.load_state_dict({k: torch.from_numpy(v) for k, v in hf_to_transformers(weights).items()})
        self.dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        layer = layer.to(self.dtype)
        # A bf16 serving run keeps the decay parameters fp32 (their original values, not bf16-rounded).
        layer.forget_gate.A_log.data = torch.from_numpy(weights["A_log"])
        layer.forget_gate.dt_bias.data = torch.from_numpy(weights["dt_bias"])
        self.layer = layer.eval()
        self.chunk_hook = chunk_hook

    def prefill(
        self, x: np.ndarray, initial_state: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One sequence `x [T, hidden]` → (out [T, hidden], final recurrent state [H, D, D]), float32."""
        torch = self.torch
        init = None if initial_state is None else torch.from_numpy(initial_state[None])
        with torch.no_grad(), self.chunk_hook.start(init):
            out = self.layer(torch.from_numpy(x)[None].to(self.dtype))[0]
        return out.float().numpy(), self.chunk_hook.final_state[0].float().numpy()

    def prefill_packed(
        self, xs: Sequence[np.ndarray], initial_states: np.ndarray | None = None
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """Each sequence on its own (transformers has no packed batches): outputs and states [N, H, D, D]."""
        results = [
            self.prefill(x, None if initial_states is None else initial_states[i]) for i, x in enumerate(xs)
        ]
        return [out for out, _ in results], np.stack([state for _, state in results])


class _ChunkHook:
    """Calls the pure-torch chunk function with a chosen initial state and keeps its final state."""

    def __init__(self, chunk_fn: Callable[..., Any]):
        self.chunk_fn = chunk_fn
        self.initial_state = None
        self.final_state = None

    @contextlib.contextmanager
    def start(self, initial_state: Any) -> Iterator[None]:
        self.initial_state, self.final_state = initial_state, None
        try:
            yield
        finally:
            self.initial_state = None

    def __call__(
        self, *args: Any, initial_state: Any = None, output_final_state: bool = False, **kwargs: Any
    ):
        if initial_state is None:
            initial_state = self.initial_state
        out, final = self.chunk_fn(*args, initial_state=initial_state, output_final_state=True, **kwargs)
        self.final_state = final
        return out, (final if output_final_state else None)


@pytest.fixture(scope="module")
def torch_reference() -> Iterator[Callable[[str, str], TorchReference]]:
    """`torch_reference(config_name, dtype_name)`: transformers' layer with the runners' weights (seed 0).

    Module-scoped: transformers' module functions are patched only while one test file runs, so the
    files that run after it in the same (xdist) worker, e.g. dump_gen's, see transformers unpatched."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    torch.manual_seed(0)
    names = (
        "chunk_kimi_delta_attention",
        "recurrent_kimi_delta_attention",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    pure = {name: getattr(getattr(hf, name), "__wrapped__", getattr(hf, name)) for name in names}
    hook = _ChunkHook(pure["chunk_kimi_delta_attention"])
    cache: dict[tuple[str, str], TorchReference] = {}

    def get(config_name: str, dtype_name: str = "fp32") -> TorchReference:
        key = (config_name, dtype_name)
        if key not in cache:
            config = CONFIGS[config_name]
            cache[key] = TorchReference(config, synthetic_weights(config, seed=0), dtype_name, hook)
        return cache[key]

    with pytest.MonkeyPatch.context() as patch:
        for name, fn in pure.items():
            patch.setattr(hf, name, fn)
        patch.setattr(hf, "chunk_kimi_delta_attention", hook)
        yield get
