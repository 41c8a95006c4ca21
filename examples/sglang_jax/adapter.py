"""sglang-jax's KDA under the conformance suite: `--impl examples.sglang_jax.adapter:SglangJaxAdapter`.

Imports sgl_jax from a checkout (`--impl-option sglang_jax=/path/to/sglang-jax`, else `$SGLANG_JAX`)
and drives its own code wherever it imports:

- the layer: sglang-jax's `KimiDeltaAttention` module (its `LinearBase` projections, conv weight
  containers, `A_log`, `dt_bias`, `GatedRMSNorm`) loaded from the dump's weights (examples/sglang_jax/
  layout.py), run by `forward` below, which composes the module's parts in the order of its
  `__call__` so that it can also return `beta`, `g_out` and `o_norm`;
- the attention: `RadixLinearAttention` → `HybridLinearAttnBackend` → `KDAAttnBackend` (short conv,
  l2 norm, Pallas `chunk_kda_fwd` for prefill with the gate in the kernel, `naive_recurrent_kda` for
  decode), with states in a `RecurrentStatePool` and the backend's own `get_forward_metadata`;
- the kernel checks: `chunk_kda_fwd` (Pallas; interpreted on a CPU) and `naive_recurrent_kda`.
- the raw-gate kernel checks (`RawGateKernelAdapter`): `chunk_kda_fwd` called as `KDAAttnBackend`'s
  prefill calls it (`use_gate_in_kernel=True`, `A_log` [H], `dt_bias` [H, K], `safe_gate` its default
  True; a lower bound L, which no sgl-jax model passes, as `lower_bound=L`), and its decode path:
  `KDAAttnBackend._fused_kda_gate` then `naive_recurrent_kda` (softplus gate only: a lower bound raises
  NotImplementedError, so those checks skip).
- the serving checks (docs/serving.md): one `RecurrentStatePool` (slot 0 its dummy), the slots from its
  `HybridReqToTokenPool`'s free list, each batch laid out as `ScheduleBatch.get_model_worker_batch`
  lays it out (`has_initial_state = prefix_lens > 0` in EXTEND, padding requests on slot 0) and run
  through the same layer path with the backend's `get_forward_metadata`; the optional verbs:
  `serving_copy` through the pool's `copy_slots` (the copy-on-write of `--enable-unified-radix-tree`),
  `serving_load` through the backend's `set_ssm_state` / `set_conv_state`; no `serving_accept` (its KDA
  backend refuses TARGET_VERIFY). With `track_interval` the extra-buffer track slots are driven:
  `HybridReqToTokenPool` with `enable_recurrent_extra_buffer`, each forward's track entries from
  `_build_recurrent_track_entries`, a boundary's snapshot copied from its track slot.

Options (strings): `sglang_jax` the checkout; `interpret` `1|0` Pallas interpret mode (default: on
unless a TPU is present); `track_interval` N > 0, sgl-jax's `--recurrent-track-interval` (default: no
track slots). sgl_jax's package `__init__`s import server-only modules (zmq, fastapi,
orjson, partial_json_parser) that the layer never calls; where they are not installed, placeholders
stand in (`stub_server_modules`), and using one raises.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import os
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conformance.adapter import (
    KernelAdapter,
    LayerAdapter,
    LayerResult,
    RawGateKernelAdapter,
    ServingAdapter,
)
from examples.sglang_jax.layout import check_state, conv_state_to_dump, seq_lens_of, sglang_jax_params
from kda_spec.families import KIMI_LINEAR

CHECKOUT_OPTION, CHECKOUT_ENV = "sglang_jax", "SGLANG_JAX"
TRACK_OPTION = "track_interval"
PING_PONG_SLOTS = 2  # a request's track slots under --enable-recurrent-extra-buffer (overlap scheduling)
SERVER_ONLY_MODULES = (
    "zmq",
    "fastapi",
    "fastapi.responses",
    "orjson",
    "partial_json_parser",
    "partial_json_parser.core",
    "partial_json_parser.core.exceptions",
    "partial_json_parser.core.options",
)
RUN_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
DUMMY_SLOT = 0  # the pool's per-rank dummy slot; sequences use slots 1..N


class _Placeholder(types.ModuleType):
    """A server-only module sgl_jax imports at package level but the KDA layer never uses."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name} is a placeholder: install {self.__name__} to use it")

        return type(name, (), {"__init__": unavailable})


def stub_server_modules() -> list[str]:
    """Placeholders for the server-only modules that are not installed; returns their names."""
    stubbed = []
    for name in SERVER_ONLY_MODULES:
        top = name.split(".")[0]
        if name in sys.modules:
            continue
        if not isinstance(sys.modules.get(top), _Placeholder) and importlib.util.find_spec(top) is not None:
            continue  # installed: the real module is used
        module = _Placeholder(name)
        module.__path__ = []
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


def import_sgl_jax(checkout: str) -> Path:
    """Make `sgl_jax` importable from a sglang-jax checkout (its `python/` folder); returns that folder."""
    root = Path(checkout).expanduser()
    source = root / "python" if (root / "python" / "sgl_jax").is_dir() else root
    if not (source / "sgl_jax" / "srt" / "kernels" / "kda").is_dir():
        raise ValueError(
            f"{CHECKOUT_OPTION}={checkout!r}: no sgl_jax/srt/kernels/kda under {root} or {root}/python"
        )
    if str(source) not in sys.path:
        sys.path.insert(0, str(source))
    return source


@dataclasses.dataclass(frozen=True)
class SglangCarry:
    """The states of N sequences after a call, in sglang-jax's layouts."""

    recurrent: np.ndarray  # [N, H, K, V] float32
    conv: np.ndarray  # [N, 3P, W-1] float32 (values of the run dtype)

    @property
    def num_seqs(self) -> int:
        return self.recurrent.shape[0]


class SglangJaxAdapter(LayerAdapter, KernelAdapter, RawGateKernelAdapter, ServingAdapter):
    """sglang-jax's KDA layer and kernels; `kernel` is ignored (its prefill is the Pallas chunk kernel,
    its decode the naive recurrence)."""

    name = "sglang-jax"
    # Kimi-Linear only: its one KDA layer (`KimiDeltaAttention`: three convs, the softplus gate, a decode
    # gate without a bound) cannot serve a lower-bound family, though its chunk kernel takes a bound
    # (examples/sglang_jax/README.md, "Families").
    FAMILIES: ClassVar[frozenset[str]] = frozenset({KIMI_LINEAR.name})
    OPTIONS: ClassVar[Mapping[str, str]] = {
        CHECKOUT_OPTION: f"path of a sglang-jax checkout (default: ${CHECKOUT_ENV})",
        "interpret": "1 or 0: run the Pallas kernels in interpret mode (default: 1 unless on a TPU)",
        TRACK_OPTION: "N > 0: the serving pool's extra-buffer track slots, snapshots every N tokens "
        "(sgl-jax's --recurrent-track-interval; default: none)",
    }

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        checkout, interpret = self.options[CHECKOUT_OPTION], self.options["interpret"]
        os.environ["PALLAS_INTERPRET"] = interpret  # read by sgl_jax's kernels at trace time
        self._source = import_sgl_jax(checkout)
        self._stubbed = stub_server_modules()
        self._sgl = _SglJax.load()
        self._run_dtype = RUN_DTYPES[self.dtype]
        self._mesh = jax.make_mesh((1, 1), ("data", "tensor"))
        self._layer_idx = min((i - 1 for i in self.config.kda_layers), default=0)
        self._module = self._build_module(sglang_jax_params(self.config, self.weights))
        self._kda_backend = self._sgl.KDAAttnBackend(mesh=self._mesh)
        self._backend = self._sgl.HybridLinearAttnBackend(
            full_attn_backend=None, linear_attn_backend=self._kda_backend, full_attn_layers=()
        )
        self._forward = {mode: self._jit_forward(mode) for mode in ("extend", "decode")}
        self._chunk = jax.jit(self._chunk_call)
        self._chunk_raw_gate = jax.jit(self._chunk_raw_gate_call, static_argnames=("lower_bound",))
        self._copy_slots = jax.jit(lambda pool, src, dst: pool.copy_slots(src, dst), donate_argnums=0)

    @classmethod
    def parse_options(cls, options: Mapping[str, str]) -> dict[str, Any]:
        values = super().parse_options(options)
        checkout = values.get(CHECKOUT_OPTION) or os.environ.get(CHECKOUT_ENV)
        if not checkout:
            raise ValueError(
                f"give the sglang-jax checkout: --impl-option {CHECKOUT_OPTION}=PATH or ${CHECKOUT_ENV}"
            )
        interpret = values.get("interpret", "0" if jax.default_backend() == "tpu" else "1")
        if interpret not in ("0", "1"):
            raise ValueError(f"--impl-option interpret={interpret!r}: expected 1 or 0")
        track = values.get(TRACK_OPTION)
        if track is not None and not (str(track).isdigit() and int(track) > 0):
            raise ValueError(f"--impl-option {TRACK_OPTION}={track!r}: expected a whole number > 0")
        return {
            CHECKOUT_OPTION: checkout,
            "interpret": interpret,
            TRACK_OPTION: None if track is None else int(track),
        }

    @property
    def kernel_used(self) -> str:
        """Its Pallas prefill kernel and how it ran: `pallas (interpret, cpu)` or `pallas (mosaic, tpu)`."""
        mode = "interpret" if self.options["interpret"] == "1" else "mosaic"
        return f"pallas ({mode}, {jax.default_backend()})"

    def describe(self) -> dict[str, Any]:
        return {
            "jax": jax.__version__,
            "device": str(jax.devices()[0]),
            "sgl_jax": str(self._source),
            "pallas_interpret": os.environ["PALLAS_INTERPRET"],
            "placeholders": self._stubbed,
            TRACK_OPTION: self.options[TRACK_OPTION],
        }

    # --- the module -----------------------------------------------------------------------------------

    def _build_module(self, params: dict[str, np.ndarray]) -> Any:
        c = self.config
        hf_config = types.SimpleNamespace(
            hidden_size=c.hidden_size,
            rms_norm_eps=c.rms_norm_eps,
            linear_attn_config={
                "short_conv_kernel_size": c.conv_size,
                "head_dim": c.head_dim,
                "num_heads": c.num_heads,
            },
        )
        with jax.set_mesh(self._mesh):
            module = self._sgl.KimiDeltaAttention(hf_config, self._layer_idx, self._mesh, self._run_dtype)
        for path, value in params.items():
            param = _attribute(module, path)
            current = param.value  # keep the dtype, shape and sharding sglang-jax gave it
            param.value = jax.device_put(
                np.asarray(value).reshape(current.shape).astype(current.dtype), current.sharding
            )
        return module

    def _jit_forward(self, mode: str) -> Any:
        """One jitted forward per mode; nnx.jit carries the module and the backend (its metadata set by
        the caller) in as state, so new metadata does not recompile."""
        forward_mode = self._sgl.ForwardMode.EXTEND if mode == "extend" else self._sgl.ForwardMode.DECODE

        @nnx.jit
        def forward(module: Any, backend: Any, x: jax.Array, pool: Any) -> tuple[jax.Array, Any, dict]:
            batch = types.SimpleNamespace(attn_backend=backend, forward_mode=forward_mode)
            return forward_layer(module, x, batch, pool)

        return forward

    # --- layer ----------------------------------------------------------------------------------------

    def layer_extend(
        self,
        hidden_states: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None = None,
        carry: SglangCarry | None = None,
    ) -> LayerResult:
        seq_lens = seq_lens_of(cu_seqlens, hidden_states.shape[0])
        if initial_state is not None and carry is not None:
            raise ValueError("pass initial_state (fresh sequences) or carry (continued ones), not both")
        if carry is None:
            state = (
                np.zeros(
                    (seq_lens.size, self.config.num_heads, self.config.head_dim, self.config.head_dim),
                    np.float32,
                )
                if initial_state is None
                else check_state(initial_state, self.config, seq_lens.size)
            )
            conv = np.zeros((seq_lens.size, 3 * self.config.proj_dim, self.config.conv_size - 1), np.float32)
            carry = SglangCarry(state, conv)
        self._check_carry(carry, seq_lens.size)
        return self._run("extend", hidden_states, seq_lens, carry)

    def layer_decode(self, hidden_states: np.ndarray, carry: SglangCarry) -> LayerResult:
        if carry is None:
            raise ValueError("layer_decode continues the sequences of a carry; got carry=None")
        self._check_carry(carry, hidden_states.shape[0])
        return self._run("decode", hidden_states, np.ones(carry.num_seqs, np.int32), carry)

    @staticmethod
    def _check_carry(carry: SglangCarry, num_seqs: int) -> None:
        if not isinstance(carry, SglangCarry):
            raise TypeError(f"carry must come from this adapter (a SglangCarry), got {type(carry).__name__}")
        if carry.num_seqs != num_seqs:
            raise ValueError(f"the carry holds {carry.num_seqs} sequences, the call has {num_seqs}")

    def _run(
        self, mode: str, hidden_states: np.ndarray, seq_lens: np.ndarray, carry: SglangCarry
    ) -> LayerResult:
        num_seqs = seq_lens.size
        slots = np.arange(1, num_seqs + 1, dtype=np.int32)
        pool = self._sgl.RecurrentStatePool(
            [self._layer_idx],
            num_seqs,
            self.config.num_heads,
            self.config.head_dim,
            self.config.conv_size,
            self._mesh,
            temporal_dtype=jnp.float32,
            conv_dtype=self._run_dtype,
        )
        recurrent_buffer, (conv_buffer,) = pool.get_linear_recurrent_layer_cache(self._layer_idx)
        recurrent, conv = np.array(_to_numpy(recurrent_buffer)), np.array(_to_numpy(conv_buffer))
        recurrent[slots], conv[slots] = carry.recurrent, carry.conv
        pool.replace_buffer(
            (
                [jax.device_put(recurrent, pool.recurrent_sharding)],
                [[jax.device_put(conv.astype(pool.conv_dtype), pool.conv_sharding)]],
            )
        )
        worker_batch = types.SimpleNamespace(
            forward_mode=self._sgl.ForwardMode.EXTEND if mode == "extend" else self._sgl.ForwardMode.DECODE,
            extend_seq_lens=seq_lens,
            dp_size=1,
            per_dp_bs_size=num_seqs,
            recurrent_indices=slots,
            has_initial_state=np.ones(num_seqs, bool),
            recurrent_track_indices=None,
            recurrent_track_mask=None,
        )
        self._kda_backend.forward_metadata = self._kda_backend.get_forward_metadata(worker_batch)
        x = jnp.asarray(hidden_states, jnp.float32).astype(self._run_dtype)
        with jax.set_mesh(self._mesh):
            out, (new_recurrent, (new_conv,)), intermediates = self._forward[mode](
                self._module, self._backend, x, pool
            )
        new_carry = SglangCarry(recurrent=_to_numpy(new_recurrent)[slots], conv=_to_numpy(new_conv)[slots])
        named = {name: _to_numpy(value) for name, value in intermediates.items()}
        named["final_conv_state"] = conv_state_to_dump(new_carry.conv)
        return LayerResult(
            out=_to_numpy(out), final_state=new_carry.recurrent, carry=new_carry, intermediates=named
        )

    # --- kernels --------------------------------------------------------------------------------------

    def chunk_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        """`chunk_kda_fwd` on the packed batch: q, k fp32 as the harness gives them, v in the run dtype,
        g (log decay per token, natural log) and beta fp32; o rounded to the run dtype."""
        seq_lens = seq_lens_of(cu_seqlens, q.shape[0])
        state = self._state_or_zeros(initial_state, seq_lens.size)
        o, final = self._chunk(
            *(jnp.asarray(x, jnp.float32)[None] for x in (q, k)),
            jnp.asarray(v, jnp.float32).astype(self._run_dtype)[None],
            *(jnp.asarray(x, jnp.float32)[None] for x in (g, beta)),
            jnp.asarray(state),
            jnp.asarray(cu_seqlens, jnp.int32),
        )
        return _to_numpy(o[0].astype(self._run_dtype)), _to_numpy(final)

    def _chunk_call(self, q, k, v, g, beta, initial_state, cu_seqlens):
        o, final, *_ = self._sgl.chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=self.config.head_dim**-0.5,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
        )
        return o, final

    def recurrent_kernel(self, q, k, v, g, beta, cu_seqlens, initial_state):
        """`naive_recurrent_kda` (one sequence at a time: it takes no cu_seqlens), same dtypes as above."""
        cu = np.asarray(cu_seqlens)
        seq_lens = seq_lens_of(cu, q.shape[0])
        state = self._state_or_zeros(initial_state, seq_lens.size)
        outputs, finals = [], []
        for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
            o, final = self._sgl.naive_recurrent_kda(
                *(jnp.asarray(x[lo:hi], jnp.float32)[None] for x in (q, k)),
                jnp.asarray(v[lo:hi], jnp.float32).astype(self._run_dtype)[None],
                *(jnp.asarray(x[lo:hi], jnp.float32)[None] for x in (g, beta)),
                scale=self.config.head_dim**-0.5,
                initial_state=jnp.asarray(state[i : i + 1]),
                output_final_state=True,
            )
            outputs.append(_to_numpy(o[0].astype(self._run_dtype)))
            finals.append(_to_numpy(final[0]))
        return np.concatenate(outputs), np.stack(finals)

    def chunk_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        """`chunk_kda_fwd` as `KDAAttnBackend._forward_extend` calls it: the raw gate g_raw [T, H, K] in the
        run dtype (the layer's `f_b_proj` output), `use_gate_in_kernel=True`, `A_log` [H] and `dt_bias`
        [H, K] fp32 (the layer's parameters), `safe_gate` its default (True); with a lower bound L also
        `lower_bound=L`, which the kernel takes though no sgl-jax model passes it. q, k, v, beta, the
        states and o as in `chunk_kernel`."""
        seq_lens = seq_lens_of(cu_seqlens, q.shape[0])
        state = self._state_or_zeros(initial_state, seq_lens.size)
        a_log, dt_bias = self._gate_params(a_log, dt_bias)
        o, final = self._chunk_raw_gate(
            *(jnp.asarray(x, jnp.float32)[None] for x in (q, k)),
            *(jnp.asarray(x, jnp.float32).astype(self._run_dtype)[None] for x in (v, g_raw)),
            jnp.asarray(beta, jnp.float32)[None],
            jnp.asarray(state),
            jnp.asarray(cu_seqlens, jnp.int32),
            jnp.asarray(a_log),
            jnp.asarray(dt_bias),
            lower_bound=None if lower_bound is None else float(lower_bound),
        )
        return _to_numpy(o[0].astype(self._run_dtype)), _to_numpy(final)

    def _chunk_raw_gate_call(
        self, q, k, v, g_raw, beta, initial_state, cu_seqlens, a_log, dt_bias, *, lower_bound
    ):
        bound = {} if lower_bound is None else {"lower_bound": lower_bound}
        o, final, *_ = self._sgl.chunk_kda(
            q,
            k,
            v,
            g_raw,
            beta,
            scale=self.config.head_dim**-0.5,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            use_gate_in_kernel=True,
            A_log=a_log,
            dt_bias=dt_bias,
            **bound,
        )
        return o, final

    def recurrent_kernel_raw_gate(
        self, q, k, v, g_raw, beta, a_log, dt_bias, lower_bound, cu_seqlens, initial_state
    ):
        """sglang-jax's decode path: `KDAAttnBackend._fused_kda_gate` on the raw gate in the run dtype (the
        softplus gate in fp32, cast back to that dtype: bf16 in the bf16 run), then `naive_recurrent_kda`
        as in `recurrent_kernel`. Its decode gate has no lower bound: NotImplementedError for one."""
        if lower_bound is not None:
            raise NotImplementedError(
                "sglang-jax's decode gate (KDAAttnBackend._fused_kda_gate) is the softplus gate only: "
                f"it takes no lower bound (got {lower_bound})"
            )
        a_log, dt_bias = self._gate_params(a_log, dt_bias)
        parameters = types.SimpleNamespace(  # what `_fused_kda_gate` reads of its layer
            A_log=types.SimpleNamespace(value=jnp.asarray(a_log)),
            dt_bias=types.SimpleNamespace(value=jnp.asarray(dt_bias)),
        )
        g = self._kda_backend._fused_kda_gate(
            parameters, jnp.asarray(g_raw, jnp.float32).astype(self._run_dtype)
        )
        return self.recurrent_kernel(q, k, v, _to_numpy(g), beta, cu_seqlens, initial_state)

    def _gate_params(self, a_log: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """a_log [H] and dt_bias [H·K] as the backend passes the layer's: fp32 [H] and [H, K]."""
        heads, dim = self.config.num_heads, self.config.head_dim
        a_log, dt_bias = np.asarray(a_log, np.float32), np.asarray(dt_bias, np.float32)
        if a_log.shape != (heads,):
            raise ValueError(f"a_log has shape {a_log.shape}, expected ({heads},)")
        if dt_bias.shape != (heads * dim,):
            raise ValueError(f"dt_bias has shape {dt_bias.shape}, expected ({heads * dim},)")
        return a_log, dt_bias.reshape(heads, dim)

    def _state_or_zeros(self, initial_state: np.ndarray | None, num_seqs: int) -> np.ndarray:
        if initial_state is None:
            d = self.config.head_dim
            return np.zeros((num_seqs, self.config.num_heads, d, d), np.float32)
        return check_state(initial_state, self.config, num_seqs)

    # --- serving (docs/serving.md) ----------------------------------------------------------------------

    def serving_open(self, num_slots: int) -> None:
        """sglang-jax's `RecurrentStatePool` (+ the dummy slot 0) and its `HybridReqToTokenPool`, whose
        free list hands out and takes back the recurrent slots; with `track_interval` the pool holds
        `request_owned_slots` (a running slot and two ping-pong track slots) per request, as sgl-jax's
        `--enable-recurrent-extra-buffer` sizes it."""
        c = self.config
        interval = self.options[TRACK_OPTION]
        per_request = 1 + PING_PONG_SLOTS if interval else 1
        self._serving_pool = self._sgl.RecurrentStatePool(
            [self._layer_idx],
            num_slots * per_request,
            c.num_heads,
            c.head_dim,
            c.conv_size,
            self._mesh,
            temporal_dtype=jnp.float32,
            conv_dtype=self._run_dtype,
        )
        self._req_pool = self._sgl.HybridReqToTokenPool(
            size=num_slots,
            max_context_len=1,
            dtype=np.int32,
            recurrent_state_pool=self._serving_pool,
            enable_recurrent_extra_buffer=bool(interval),
            ping_pong_slots=PING_PONG_SLOTS,
        )
        self._requests: dict[int, types.SimpleNamespace] = {}  # running slot -> its request
        self._serving_host: tuple[np.ndarray, np.ndarray] | None = None

    def serving_alloc(self) -> int:
        """A request's slots from `HybridReqToTokenPool.alloc`: its running slot (returned), and with
        `track_interval` its ping-pong track slots."""
        request = types.SimpleNamespace(
            req_pool_idx=None, recurrent_pool_idx=None, dp_rank=0, is_chunked=0, kv_committed_len=0
        )
        if self._req_pool.alloc([request]) is None:
            raise RuntimeError("sglang-jax's recurrent free list is empty")
        request.seq_len = 0  # the tokens its slot's states have processed (None: not known here)
        self._requests[request.recurrent_pool_idx] = request
        return int(request.recurrent_pool_idx)

    def serving_free(self, slot: int) -> None:
        """`HybridReqToTokenPool.free`: the running slot and any track slots back to the free list."""
        self._req_pool.free(self._requests.pop(slot))

    def serving_forward(
        self,
        mode: str,
        hidden_states: np.ndarray,
        seq_lens: np.ndarray,
        slots: np.ndarray,
        prefix_lens: np.ndarray,
        padding_rows: int,
    ) -> np.ndarray:
        """One batch as sglang-jax's `ScheduleBatch.get_model_worker_batch` lays it out: the requests,
        then padding requests (recurrent index 0, the dummy slot; `has_initial_state` True as its
        `np.ones` leaves them) up to a request bucket; EXTEND: `has_initial_state = prefix_lens > 0`,
        padding requests of 0 tokens, the suite's padding rows and the token bucket's after the last
        request's tokens; DECODE: one padding request per padding row. Track slots: without
        `track_interval` none (`recurrent_track_indices` None, no `--enable-recurrent-extra-buffer`); with
        it sgl-jax's `_build_recurrent_track_entries` for the requests (a request whose forward ends on a
        multiple of the interval has its state scattered into its next ping-pong track slot by the
        backend), zeros for the padding requests."""
        if mode not in ("extend", "decode"):
            raise ValueError(f"mode must be 'extend' or 'decode', got {mode!r}")
        real, rows, num_reqs = int(np.sum(seq_lens)), hidden_states.shape[0], len(seq_lens)
        if rows != real + padding_rows:
            raise ValueError(
                f"hidden_states has {rows} rows; the batch has {real} tokens + {padding_rows} padding"
            )
        batch_reqs = num_reqs + (padding_rows if mode == "decode" else 0)
        per_dp_bs = _bucket(batch_reqs, 4)
        num_tokens = per_dp_bs if mode == "decode" else _bucket(rows, 16)
        recurrent_indices = np.zeros(per_dp_bs, np.int32)
        recurrent_indices[:num_reqs] = slots
        has_initial_state = np.ones(per_dp_bs, bool)
        extend_seq_lens = None
        if mode == "extend":
            extend_seq_lens = np.zeros(per_dp_bs, np.int32)
            extend_seq_lens[:num_reqs] = seq_lens
            has_initial_state[:num_reqs] = np.asarray(prefix_lens) > 0
        track_indices, track_mask = self._track_entries(mode, seq_lens, slots, prefix_lens, per_dp_bs)
        forward_mode = self._sgl.ForwardMode.EXTEND if mode == "extend" else self._sgl.ForwardMode.DECODE
        worker_batch = types.SimpleNamespace(
            forward_mode=forward_mode,
            extend_seq_lens=extend_seq_lens,
            dp_size=1,
            per_dp_bs_size=per_dp_bs,
            recurrent_indices=recurrent_indices,
            has_initial_state=has_initial_state,
            recurrent_track_indices=track_indices,
            recurrent_track_mask=track_mask,
        )
        self._kda_backend.forward_metadata = self._kda_backend.get_forward_metadata(worker_batch)
        x = np.zeros((num_tokens, self.config.hidden_size), np.float32)
        x[:rows] = hidden_states
        self._serving_host = None
        with jax.set_mesh(self._mesh):
            out, (new_recurrent, (new_conv,)), _ = self._forward[mode](
                self._module, self._backend, jnp.asarray(x).astype(self._run_dtype), self._serving_pool
            )
        self._serving_pool.replace_buffer(([new_recurrent], [[new_conv]]))
        for slot, prefix, n in zip(slots, prefix_lens, seq_lens, strict=True):
            self._requests[int(slot)].seq_len = int(prefix) + int(n)
        return _to_numpy(out)[:rows]

    def _track_entries(
        self, mode: str, seq_lens: np.ndarray, slots: np.ndarray, prefix_lens: np.ndarray, per_dp_bs: int
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The batch's `recurrent_track_indices` and `recurrent_track_mask` [per_dp_bs] as sgl-jax's
        `prepare_for_extend` / `prepare_for_decode` build them (`_build_recurrent_track_entries`, which
        flips each boundary request's ping-pong index) for the N requests (seq_lens, slots, prefix_lens
        [N]), zeros for the padding requests; None, None without `track_interval`."""
        interval = self.options[TRACK_OPTION]
        if not interval:
            return None, None
        requests = [self._requests[int(slot)] for slot in slots]
        for request, n in zip(requests, seq_lens, strict=True):
            request.extend_input_len = int(n)
        indices, mask = np.zeros(per_dp_bs, np.int32), np.zeros(per_dp_bs, np.int32)
        if requests:
            final_lens = [int(p) + int(n) for p, n in zip(prefix_lens, seq_lens, strict=True)]
            built = self._sgl.build_recurrent_track_entries(
                requests, final_lens, interval=interval, pool=self._req_pool, is_extend=mode == "extend"
            )
            indices[: len(requests)], mask[: len(requests)] = built
        return indices, mask

    def serving_copy(self, src: int, dst: int) -> None:
        """`RecurrentStatePool.copy_slots` (jitted, the pool donated, as sgl-jax's model runner runs it
        for `--enable-unified-radix-tree`: `_maybe_apply_recurrent_cow`) from `src`'s snapshot into `dst`.
        The snapshot is `src`'s running slot, or, with `track_interval`, its track slot holding the state
        of its last boundary when its last forward ended there (the slot sgl-jax's radix tree takes)."""
        source = self._snapshot_slot(src)
        with jax.set_mesh(self._mesh):
            recurrent, conv = self._copy_slots(
                self._serving_pool, self._slot_indices(source), self._slot_indices(dst)
            )
        self._serving_pool.replace_buffer((recurrent, conv))
        self._requests[dst].seq_len = self._requests[src].seq_len
        self._serving_host = None

    def _snapshot_slot(self, slot: int) -> int:
        """Where `slot`'s request's current states are published: its keep ping-pong track slot when its
        last boundary snapshot is at its current length, else the running slot itself."""
        request = self._requests[slot]
        last = getattr(request, "recurrent_last_track_seqlen", None)
        if last is None or last != request.seq_len:
            return slot
        return int(
            request.recurrent_ping_pong_track_buffer[self._req_pool.get_recurrent_ping_pong_keep_idx(request)]
        )

    def serving_load(self, slot: int, recurrent: np.ndarray, conv: np.ndarray) -> None:
        """The slot's states written with the backend's own scatters, `KDAAttnBackend.set_ssm_state` and
        `set_conv_state` (sgl-jax has no import of a slot: its disaggregation moves KV pages only).
        recurrent: [H, K, V] float32; conv: [W-1, 3P] float32 (run-dtype values)."""
        c = self.config
        shapes = {
            "recurrent": (c.num_heads, c.head_dim, c.head_dim),
            "conv": (c.conv_size - 1, 3 * c.proj_dim),
        }
        for name, value in (("recurrent", recurrent), ("conv", conv)):
            if np.shape(value) != shapes[name]:
                raise ValueError(f"serving_load {name} has shape {np.shape(value)}, expected {shapes[name]}")
        pool, index = self._serving_pool, self._slot_indices(slot)
        packed_conv = np.asarray(conv, np.float32).T[None]  # [1, 3P, W-1], the pool's layout
        with jax.set_mesh(self._mesh):
            new_recurrent = self._kda_backend.set_ssm_state(
                pool,
                self._layer_idx,
                index,
                jax.device_put(np.asarray(recurrent, np.float32)[None], pool.recurrent_sharding),
            )
            new_conv = self._kda_backend.set_conv_state(
                pool,
                self._layer_idx,
                index,
                jax.device_put(jnp.asarray(packed_conv).astype(pool.conv_dtype), pool.conv_sharding),
            )
        pool.replace_buffer(([new_recurrent], [new_conv]))
        self._requests[slot].seq_len = None
        self._serving_host = None

    def _slot_indices(self, *slots: int) -> jax.Array:
        """Slot indices [n] int32 on the data axis, as sgl-jax's `device_array` puts its batch's."""
        return jax.device_put(np.asarray(slots, np.int32), NamedSharding(self._mesh, P("data")))

    # No serving_accept (and so no mode "verify"): `KDAAttnBackend.__call__` at cddbf6f runs EXTEND and
    # DECODE only and raises NotImplementedError for TARGET_VERIFY, and `--enable-recurrent-extra-buffer`
    # refuses speculative decoding; the scenarios that verify skip with the protocol's reason.

    def serving_state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        if self._serving_host is None:
            recurrent, (conv,) = self._serving_pool.get_linear_recurrent_layer_cache(self._layer_idx)
            self._serving_host = (_to_numpy(recurrent), _to_numpy(conv))
        recurrent, conv = self._serving_host
        return recurrent[slot].copy(), np.ascontiguousarray(conv[slot].T)


def forward_layer(
    module: Any, x: jax.Array, batch: Any, pool: Any
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """sglang-jax's `KimiDeltaAttention.__call__`, step for step, also returning beta, g_out, o_norm."""
    tokens, heads, dim = x.shape[0], module.num_heads, module.head_dim
    q, _ = module.q_proj(x)
    k, _ = module.k_proj(x)
    v, _ = module.v_proj(x)
    raw_gate, _ = module.f_b_proj(module.f_a_proj(x)[0])
    raw_gate = raw_gate.reshape(tokens, heads, dim)
    beta = jax.nn.sigmoid(module.b_proj(x)[0].astype(jnp.float32))
    o, states = module.attn(batch, q, k, v, raw_gate, beta, pool)
    o = o.reshape(tokens, heads, dim)
    output_gate, _ = module.g_b_proj(module.g_a_proj(x)[0])
    output_gate = output_gate.reshape(tokens, heads, dim)
    o_norm = module.o_norm(o, output_gate)
    out, _ = module.o_proj(o_norm.reshape(tokens, heads * dim))
    return out, states, {"beta": beta, "g_out": output_gate, "o_norm": o_norm}


@dataclasses.dataclass(frozen=True)
class _SglJax:
    """The sgl_jax names the adapter uses, imported once a checkout is on the path."""

    KimiDeltaAttention: Any
    KDAAttnBackend: Any
    HybridLinearAttnBackend: Any
    RecurrentStatePool: Any
    HybridReqToTokenPool: Any
    ForwardMode: Any
    chunk_kda: Any
    naive_recurrent_kda: Any
    build_recurrent_track_entries: Any

    @classmethod
    def load(cls) -> _SglJax:
        try:
            kda = importlib.import_module("sgl_jax.srt.kernels.kda")
            return cls(
                KimiDeltaAttention=importlib.import_module(
                    "sgl_jax.srt.models.kimi_linear"
                ).KimiDeltaAttention,
                KDAAttnBackend=importlib.import_module(
                    "sgl_jax.srt.layers.attention.linear.kda_backend"
                ).KDAAttnBackend,
                HybridLinearAttnBackend=importlib.import_module(
                    "sgl_jax.srt.layers.attention.hybrid_linear_attn_backend"
                ).HybridLinearAttnBackend,
                RecurrentStatePool=importlib.import_module(
                    "sgl_jax.srt.mem_cache.recurrent_state_pool"
                ).RecurrentStatePool,
                HybridReqToTokenPool=importlib.import_module(
                    "sgl_jax.srt.mem_cache.memory_pool"
                ).HybridReqToTokenPool,
                ForwardMode=importlib.import_module(
                    "sgl_jax.srt.model_executor.forward_batch_info"
                ).ForwardMode,
                chunk_kda=kda.chunk_kda,
                naive_recurrent_kda=kda.naive_recurrent_kda,
                build_recurrent_track_entries=importlib.import_module(
                    "sgl_jax.srt.managers.schedule_batch"
                )._build_recurrent_track_entries,
            )
        except ImportError as err:
            raise ValueError(f"cannot import sgl_jax's KDA from the checkout: {err}") from err


def _attribute(module: Any, path: str) -> Any:
    """`module.a.b` for path `a.b`; sglang-jax keeps the conv weights on its `attn` too (same objects)."""
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _bucket(n: int, minimum: int) -> int:
    """The power of two at least `n` and `minimum`: the batch's padded request or token count."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def _to_numpy(x: jax.Array) -> np.ndarray:
    """float32 numpy (bf16 values upcast exactly)."""
    return np.asarray(jnp.asarray(x, jnp.float32))
