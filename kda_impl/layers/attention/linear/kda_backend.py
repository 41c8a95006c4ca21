"""Linear-recurrent attention backends: state I/O through the pool, ForwardMode dispatch (RFC §4.3-4.4).

`LinearRecurrentAttnBackend` is shared by KDA (and later GDN): it reads each request's previous
recurrent and conv state from its pool slot, runs the kernel the forward mode asks for, and writes the
new states back. `KDAAttnBackend` binds the two kernel entry points to `kda_impl.kernels`.

| ForwardMode | behaviour |
|---|---|
| EXTEND | `_dispatch_chunk` over the packed batch (`cu_q_lens`), initial states from the slots |
| DECODE | `_dispatch_recurrent`, one token per request, states updated in their slots of the whole pool |
| IDLE / DUMMY_FIRST | zeros; the pool is returned unchanged |
| TARGET_VERIFY | `_verify`: each request's draft tokens stepped from its slot's states, one output each |
| DRAFT_EXTEND | NotImplementedError (a draft model's extend: no KDA draft model is served) |
| MIXED | ValueError: never produced; mixed chunks (`--enable-mixed-chunk`) are scheduled as EXTEND |

A TARGET_VERIFY batch writes the states after each draft token to the pool's draft buffers
(`RecurrentStatePool.with_draft_tokens`) and leaves every slot as it was, until the scheduler's
`RecurrentStatePool.accept_drafts` keeps each slot's states after the drafts it accepted.

`FORWARD_MODES` is that table as data, the one definition of what the backend serves: a refused mode
raises at its first forward (`check_forward_mode`), and a backend built with `server_args`
(`kda_impl.server_args.ServerArgs`) refuses then, before any forward, a server flag that would send it one.

Under tensor or data parallelism the backend runs inside the layer's `shard_map`: it sees one device's
heads, one data rank's requests and that rank's block of pool slots, and needs no collective.

Slots (`kda_impl.kernels.slots`): `get_forward_metadata` refuses a batch whose real rows do not each have
their own slot 1..num_slots (padding rows use the dummy slot 0). Inside `jit`, where the metadata cannot be
checked, every state read and write goes through the pool's `safe_rows` or the decode kernel's own routing:
an out-of-range or repeated slot index acts as the dummy slot and reads or writes no real request's state.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from kda_impl.kernels import chunk_kda, decode_kda_slots, fused_recurrent_kda, kernel_choice
from kda_impl.kernels.slots import as_int_array, check_request_slots
from kda_impl.layers.short_conv import conv_states_per_token, short_conv_with_state
from kda_impl.mem_cache.recurrent_state_pool import RecurrentStatePool
from kda_impl.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from kda_impl.layers.radix_linear_attention import RadixLinearAttention
    from kda_impl.model_executor.forward_batch import ForwardBatch
    from kda_impl.server_args import ServerArgs


@dataclasses.dataclass(frozen=True)
class RefusedMode:
    """A forward mode the backend does not serve: the exception its forward raises, and why."""

    error: type[Exception]
    reason: str


_NO_DRAFT_MODEL = RefusedMode(
    NotImplementedError,
    "a draft model's extend is not supported by the KDA backend (KDA serves as the target model: it "
    "verifies drafts in TARGET_VERIFY batches)",
)

#: Every ForwardMode and what the linear-recurrent backends do with it: None, they serve it (a branch of
#: `forward`); a `RefusedMode`, they refuse it. Serving another mode is its entry set to None, beside its
#: branch in `forward`; `ServerArgs` then accepts the flags that bring it.
FORWARD_MODES: dict[ForwardMode, RefusedMode | None] = {
    ForwardMode.EXTEND: None,
    ForwardMode.DECODE: None,
    ForwardMode.IDLE: None,
    ForwardMode.DUMMY_FIRST: None,
    ForwardMode.MIXED: RefusedMode(
        ValueError,
        "never reaches a linear-recurrent backend: mixed chunks (--enable-mixed-chunk) are scheduled as "
        "EXTEND batches, each segment continuing from its own slot",
    ),
    ForwardMode.DRAFT_EXTEND: _NO_DRAFT_MODEL,
    ForwardMode.TARGET_VERIFY: None,
}


def check_forward_mode(mode: ForwardMode) -> None:
    """Raise `mode`'s `RefusedMode` error, naming the mode and why, unless `FORWARD_MODES` serves it."""
    refused = FORWARD_MODES[mode]
    if refused is not None:
        raise refused.error(f"{mode.name}: {refused.reason}")


def _draft_tokens(pool: RecurrentStatePool) -> int:
    """The draft tokens per request a TARGET_VERIFY batch steps: the pool's draft buffers' k."""
    if not pool.draft_tokens:
        raise ValueError(
            "TARGET_VERIFY needs the pool's draft buffers: RecurrentStatePool.with_draft_tokens(k) first"
        )
    return pool.draft_tokens


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LinearRecurrentAttnBackendMetadata:
    """Per-batch arrays that cross the jit boundary inside the backend."""

    cu_q_lens: jax.Array  # i32[N+1] token offsets of the N requests (DECODE: 0, 1, ..., N)
    recurrent_indices: jax.Array  # i32[N] pool slot of each request: distinct 1..S, padding rows 0

    def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array], dict]:
        return (self.cu_q_lens, self.recurrent_indices), {}

    @classmethod
    def tree_unflatten(
        cls, aux: dict, children: tuple[jax.Array, jax.Array]
    ) -> LinearRecurrentAttnBackendMetadata:
        return cls(*children)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class KDAAttnBackendMetadata(LinearRecurrentAttnBackendMetadata):
    """KDA's metadata: nothing beyond the base fields yet (a place for kernel-specific ones)."""


class LinearRecurrentAttnBackend(abc.ABC):
    """Base backend of the linear-recurrent layers. Holds no weights and no pool.

    Pytree: children `(forward_metadata,)`; aux data `_static_config()` (plain constants). `mesh` is
    used outside jit only and is not carried through it.

    `server_args`: the server's flags, checked here (`ServerArgs.check_server_args`): a flag that would
    send a forward mode the backend refuses is a ValueError when the server builds its backend, not at
    the first batch of that mode. Not kept: a rebuilt (unflattened) backend has none to check.
    """

    metadata_cls: type[LinearRecurrentAttnBackendMetadata] = LinearRecurrentAttnBackendMetadata

    def __init__(self, mesh: jax.sharding.Mesh | None = None, *, server_args: ServerArgs | None = None):
        if server_args is not None:
            server_args.check_server_args()
        self.mesh = mesh
        self.forward_metadata: LinearRecurrentAttnBackendMetadata | None = None

    # --- pytree -------------------------------------------------------------------------------------

    def _static_config(self) -> tuple[Any, ...]:
        """Constructor arguments (besides mesh) that rebuild an equivalent backend in `tree_unflatten`."""
        return ()

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (self.forward_metadata,), self._static_config()

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> LinearRecurrentAttnBackend:
        backend = cls(None, *aux)
        backend.forward_metadata = children[0]
        return backend

    # --- outside jit --------------------------------------------------------------------------------

    def get_forward_metadata(
        self,
        forward_mode: ForwardMode,
        seq_lens: np.ndarray,  # [N] tokens of each request in this step
        recurrent_indices: np.ndarray,  # [N] pool slots (from RecurrentStatePool.get_recurrent_indices)
        *,
        num_slots: int,  # the pool's real slots (per data rank)
    ) -> LinearRecurrentAttnBackendMetadata:
        """The metadata of one padded batch (outside jit). DECODE batches must have one token per request.

        A row on the dummy slot 0 is a padding row (any number of them); every other row is a real
        request on its own slot 1..num_slots. ValueError naming the slot and the pool size otherwise, and
        for float or bool lengths or slots.
        """
        seq_lens = as_int_array(seq_lens, "seq_lens")
        recurrent_indices = as_int_array(recurrent_indices, "recurrent_indices")
        if seq_lens.ndim != 1 or recurrent_indices.shape != seq_lens.shape:
            raise ValueError(
                f"seq_lens {seq_lens.shape} and recurrent_indices {recurrent_indices.shape} must both be [N]"
            )
        if forward_mode == ForwardMode.DECODE and np.any(seq_lens != 1):
            raise ValueError(f"DECODE needs one token per request, got seq_lens {seq_lens.tolist()}")
        if np.any(seq_lens < 0):
            raise ValueError(f"seq_lens {seq_lens.tolist()} must be >= 0")
        check_request_slots(recurrent_indices, num_slots, padding_rows=True)
        cu_q_lens = np.concatenate([[0], np.cumsum(seq_lens)])
        return self.metadata_cls(
            cu_q_lens=jnp.asarray(cu_q_lens, jnp.int32),
            recurrent_indices=jnp.asarray(recurrent_indices, jnp.int32),
        )

    def with_forward_metadata(
        self, metadata: LinearRecurrentAttnBackendMetadata
    ) -> LinearRecurrentAttnBackend:
        """A copy of this backend bound to `metadata` (batches built ahead never share metadata)."""
        bound = copy.copy(self)
        bound.forward_metadata = metadata
        return bound

    # --- inside jit ---------------------------------------------------------------------------------

    def apply_short_conv(
        self,
        layer: RadixLinearAttention,
        forward_batch: ForwardBatch,
        mixed_qkv: jax.Array,  # [T, 3P] conv inputs: the q | k | v projections
        conv_weight: jax.Array,  # [W, 3P]
        recurrent_state_pool: RecurrentStatePool,
    ) -> tuple[jax.Array, jax.Array]:
        """The layer's causal conv, continuing each request's conv state from its slot.

        Returns `(y [T, 3P], new_conv_state [N, W-1, 3P])`; the new state is written by `forward`. A
        TARGET_VERIFY batch's new state is the state after each draft token, `[N, k, W-1, 3P]` (k the
        pool's `draft_tokens`).
        """
        check_forward_mode(forward_batch.forward_mode)
        metadata = self._metadata()
        _, conv_state = recurrent_state_pool.get_slot_states(  # [N, W-1, 3, P]: q | k | v
            layer.layer_id, metadata.recurrent_indices, padding_rows=True
        )
        num_seqs, history = conv_state.shape[:2]
        conv_state = conv_state.reshape(num_seqs, history, -1)
        y, new_conv_state = short_conv_with_state(mixed_qkv, conv_weight, conv_state, metadata.cu_q_lens)
        if forward_batch.forward_mode == ForwardMode.TARGET_VERIFY:
            steps = _draft_tokens(recurrent_state_pool)
            return y, conv_states_per_token(mixed_qkv, conv_state, metadata.cu_q_lens, steps)
        return y, new_conv_state

    def forward(
        self,
        layer: RadixLinearAttention,
        forward_batch: ForwardBatch,
        q: jax.Array,  # [T, H, K] (l2-normalised by the layer)
        k: jax.Array,  # [T, H, K]
        v: jax.Array,  # [T, H, V]
        g: jax.Array,  # [T, H, K] fp32 log decay
        beta: jax.Array,  # [T, H] fp32
        new_conv_state: jax.Array,  # [N, W-1, 3P] from `apply_short_conv` (TARGET_VERIFY: [N, k, W-1, 3P])
        recurrent_state_pool: RecurrentStatePool,
    ) -> tuple[jax.Array, RecurrentStatePool]:
        """Run the mode's kernel; return `(o [T, H, V] in q's dtype, the pool with the new states)`."""
        mode = forward_batch.forward_mode
        check_forward_mode(mode)
        if mode.is_idle():
            return jnp.zeros(v.shape, q.dtype), recurrent_state_pool
        if mode == ForwardMode.TARGET_VERIFY:
            return self._verify(layer, q, k, v, g, beta, new_conv_state, recurrent_state_pool)
        metadata = self._metadata()
        slots = metadata.recurrent_indices
        new_conv_state = new_conv_state.reshape(*new_conv_state.shape[:2], 3, -1)  # the pool's q | k | v
        if mode == ForwardMode.EXTEND:
            initial_state, _ = recurrent_state_pool.get_slot_states(layer.layer_id, slots, padding_rows=True)
            o, new_recurrent = self._dispatch_chunk(
                q[None],
                k[None],
                v[None],
                g[None],
                beta[None],
                initial_state=initial_state,
                cu_seqlens=metadata.cu_q_lens,
                scale=layer.scaling,
            )
            pool = recurrent_state_pool.set_linear_recurrent_layer_cache(
                layer.layer_id, slots, new_recurrent, new_conv_state, padding_rows=True
            )
            return o[0], pool
        if q.shape[0] != slots.shape[0]:
            raise ValueError(f"DECODE has one token per request: got T={q.shape[0]} for N={slots.shape[0]}")
        # The kernel steps the batch's slots of this layer inside the whole (donated) pool buffer; it
        # routes unsafe slot indices to the dummy slot itself, as the pool's `safe_rows` does.
        o, recurrent_buffer = self._dispatch_recurrent(
            q,
            k,
            v,
            g,
            beta,
            state_buffer=recurrent_state_pool.recurrent_buffer,
            slot_indices=slots,
            layer_index=recurrent_state_pool.layer_index(layer.layer_id),
            scale=layer.scaling,
        )
        pool = recurrent_state_pool.replace(recurrent_buffer=recurrent_buffer)
        return o, pool.set_conv_states(layer.layer_id, slots, new_conv_state, padding_rows=True)

    def _verify(
        self,
        layer: RadixLinearAttention,
        q: jax.Array,  # [T, H, K]
        k: jax.Array,  # [T, H, K]
        v: jax.Array,  # [T, H, V]
        g: jax.Array,  # [T, H, K]
        beta: jax.Array,  # [T, H]
        draft_conv: jax.Array,  # [N, k, W-1, 3P] the conv state after each draft token
        pool: RecurrentStatePool,
    ) -> tuple[jax.Array, RecurrentStatePool]:
        """A TARGET_VERIFY batch: each request's draft tokens stepped one at a time from its slot's
        state (the recurrent kernel, as k decodes step it); `(o [T, H, V], the pool with the states after
        each draft token in its draft buffers and every slot's own states unchanged)`. Tokens past the
        pool's k draft tokens of a request (only a padding request has any) get zero outputs."""
        metadata = self._metadata()
        slots, cu = metadata.recurrent_indices, metadata.cu_q_lens
        steps, tokens = _draft_tokens(pool), q.shape[0]
        state, _ = pool.get_slot_states(layer.layer_id, slots, padding_rows=True)  # [N, H, K, V]
        lengths = cu[1:] - cu[:-1]
        single = jnp.arange(slots.shape[0] + 1, dtype=jnp.int32)  # one token per request

        def draft_step(state: jax.Array, j: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            """Every request's draft token j: state [N, H, K, V] → (state after it, (that state,
            o [N, H, V], its rows i32[N], whether each request has a token j bool[N]))."""
            rows = jnp.minimum(cu[:-1] + j, tokens - 1)
            live = j < lengths
            o_j, stepped = self._dispatch_chunk_recurrent(
                q[rows][None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
                initial_state=state, cu_seqlens=single, scale=layer.scaling,
            )  # fmt: skip
            state = jnp.where(live[:, None, None, None], stepped, state)
            return state, (state, o_j[0], rows, live)

        # One traced step for all k (a scan): compiling k unrolled steps costs k times as much.
        _, (states, o_steps, rows, live) = jax.lax.scan(draft_step, state, jnp.arange(steps))
        o = (
            jnp.zeros(v.shape, q.dtype)
            .at[jnp.where(live, rows, tokens).reshape(-1)]
            .set(o_steps.reshape(-1, *v.shape[1:]).astype(q.dtype), mode="drop")
        )
        draft_conv = draft_conv.reshape(*draft_conv.shape[:3], 3, -1)  # the pool's q | k | v
        pool = pool.set_draft_states(
            layer.layer_id, slots, jnp.moveaxis(states, 0, 1), draft_conv, padding_rows=True
        )
        return o, pool

    def _metadata(self) -> LinearRecurrentAttnBackendMetadata:
        if self.forward_metadata is None:
            raise ValueError("the backend has no forward_metadata: build the batch with make_forward_batch")
        return self.forward_metadata

    @abc.abstractmethod
    def _dispatch_chunk(
        self,
        q: jax.Array,  # [1, T, H, K]
        k: jax.Array,  # [1, T, H, K]
        v: jax.Array,  # [1, T, H, V]
        g: jax.Array,  # [1, T, H, K]
        beta: jax.Array,  # [1, T, H]
        *,
        initial_state: jax.Array,  # [N, H, K, V] fp32
        cu_seqlens: jax.Array,  # i32[N+1]
        scale: float,
    ) -> tuple[jax.Array, jax.Array]:
        """Chunked prefill of a packed batch: `(o [1, T, H, V], final_state [N, H, K, V] fp32)`."""

    @abc.abstractmethod
    def _dispatch_chunk_recurrent(
        self,
        q: jax.Array,  # [1, T, H, K]
        k: jax.Array,  # [1, T, H, K]
        v: jax.Array,  # [1, T, H, V]
        g: jax.Array,  # [1, T, H, K]
        beta: jax.Array,  # [1, T, H]
        *,
        initial_state: jax.Array,  # [N, H, K, V] fp32
        cu_seqlens: jax.Array,  # i32[N+1]
        scale: float,
    ) -> tuple[jax.Array, jax.Array]:
        """The token-recurrent kernel over a packed batch: `(o [1, T, H, V], final_state [N, H, K, V]
        fp32)`."""

    @abc.abstractmethod
    def _dispatch_recurrent(
        self,
        q: jax.Array,  # [B, H, K]
        k: jax.Array,  # [B, H, K]
        v: jax.Array,  # [B, H, V]
        g: jax.Array,  # [B, H, K]
        beta: jax.Array,  # [B, H]
        *,
        state_buffer: jax.Array,  # [L, S, H, K, V] fp32, the whole pool's recurrent buffer
        slot_indices: jax.Array,  # i32[B] slots of state_buffer (0: padding; unsafe ones act as 0)
        layer_index: int,  # the layer's row of state_buffer
        scale: float,
    ) -> tuple[jax.Array, jax.Array]:
        """One decode token per request: `(o [B, H, V], state_buffer with those slots of the layer
        updated)`."""


@jax.tree_util.register_pytree_node_class
class KDAAttnBackend(LinearRecurrentAttnBackend):
    """The KDA backend; `kernel` is 'naive', 'pallas' or None (the dispatcher's automatic choice).

    One instance can serve every KDA layer of a model; `server_args` as the base class says.
    """

    metadata_cls = KDAAttnBackendMetadata

    def __init__(
        self,
        mesh: jax.sharding.Mesh | None = None,
        kernel: str | None = None,
        *,
        server_args: ServerArgs | None = None,
    ):
        super().__init__(mesh, server_args=server_args)
        self.kernel = kernel

    @property
    def kernel_used(self) -> str:
        """The implementation the kernels resolve to and how it runs, `naive (xla, cpu)`, `pallas (mosaic,
        tpu)` or `pallas (interpret, cpu)`, and under `auto` the shapes at which Pallas did not lower and
        plain JAX ran (`kda_impl.kernels.kernel_choice`)."""
        return kernel_choice(self.kernel)

    def _static_config(self) -> tuple[Any, ...]:
        return (self.kernel,)

    def _dispatch_chunk(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        *,
        initial_state: jax.Array,
        cu_seqlens: jax.Array,
        scale: float,
    ) -> tuple[jax.Array, jax.Array]:
        return chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            kernel=self.kernel,
        )

    def _dispatch_chunk_recurrent(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        *,
        initial_state: jax.Array,
        cu_seqlens: jax.Array,
        scale: float,
    ) -> tuple[jax.Array, jax.Array]:
        return fused_recurrent_kda(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
            cu_seqlens=cu_seqlens, kernel=self.kernel,
        )  # fmt: skip

    def _dispatch_recurrent(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        beta: jax.Array,
        *,
        state_buffer: jax.Array,
        slot_indices: jax.Array,
        layer_index: int,
        scale: float,
    ) -> tuple[jax.Array, jax.Array]:
        return decode_kda_slots(
            q,
            k,
            v,
            g,
            beta,
            state_buffer=state_buffer,
            slot_indices=slot_indices,
            layer_index=layer_index,
            scale=scale,
            kernel=self.kernel,
        )
