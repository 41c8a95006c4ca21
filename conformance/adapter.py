"""The adapter: how the suite drives an implementation under test.

An adapter is built from the dump's config, its float32 weights (HF names, torch layout) and a run
dtype, and answers the calls below with numpy arrays (bf16 results upcast to float32, exactly).
A call the implementation cannot answer raises `NotImplementedError`; the suite then reports the
checks that need it as *skipped* with the message, never as passed.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any

import numpy as np

from kda_spec.config import KDAConfig


@dataclasses.dataclass
class LayerResult:
    """What one layer call returns.

    out:           [T, hidden] float32 (for a bf16 run: the bf16 values, upcast).
    final_state:   [N, H, D, D] float32 recurrent state of each sequence after the call.
    carry:         opaque handle that `layer_extend(..., carry=)` / `layer_decode` continue from.
    intermediates: dump-named stage outputs (`q_after_conv`, `g`, `beta`, `o_norm`, ...) where the
                   implementation can expose them; missing ones make their checks skip.
    """

    out: np.ndarray
    final_state: np.ndarray | None = None
    carry: Any = None
    intermediates: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class KDAAdapter(abc.ABC):
    """Base class of an implementation under test. Subclass and point `--impl module:Class` at it."""

    #: A short name for reports.
    name: str = "unnamed"

    def __init__(self, config: KDAConfig, weights: dict[str, np.ndarray], dtype: str, kernel: str = "auto"):
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.kernel = kernel

    @property
    def kernel_used(self) -> str:
        """The kernel implementation actually in use (after any fallback), for the report."""
        return self.kernel

    def describe(self) -> dict[str, Any]:
        """Free-form facts for the report (versions, device, mesh, ...)."""
        return {}

    @abc.abstractmethod
    def layer_extend(
        self,
        hidden_states: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None = None,
        carry: Any = None,
    ) -> LayerResult:
        """Prefill a packed batch.

        hidden_states: [T, hidden] float32; cu_seqlens: [N+1] int32;
        initial_state: [N, H, D, D] float32 recurrent states for fresh sequences (conv state zeros);
        carry: continue the N sequences of an earlier call instead (chunked prefill).
        """

    def layer_decode(self, hidden_states: np.ndarray, carry: Any) -> LayerResult:
        """One token for each of the N sequences of `carry`: hidden_states [N, hidden]."""
        raise NotImplementedError(f"adapter {self.name!r} has no decode path")

    def chunk_kernel(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g: np.ndarray,
        beta: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The chunked kernel on a packed batch: q, k (l2-normalised), v, g [T, H, D]; beta [T, H].

        Returns (o [T, H, D], final_state [N, H, D, D]).
        """
        raise NotImplementedError(f"adapter {self.name!r} exposes no chunk kernel")

    def recurrent_kernel(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        g: np.ndarray,
        beta: np.ndarray,
        cu_seqlens: np.ndarray,
        initial_state: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The token-recurrent kernel, same arguments and results as `chunk_kernel`."""
        raise NotImplementedError(f"adapter {self.name!r} exposes no recurrent kernel")


BUILTIN_ADAPTERS = {"kda_impl": "conformance.adapters.kda_impl_adapter:KDAImplAdapter"}


def load_adapter_class(spec: str) -> type[KDAAdapter]:
    """Resolve `kda_impl` or `package.module:Attr` to an adapter class, with a clear error."""
    target = BUILTIN_ADAPTERS.get(spec, spec)
    if ":" not in target:
        raise ValueError(
            f"--impl {spec!r}: expected a built-in name {sorted(BUILTIN_ADAPTERS)} or 'package.module:Attr'"
        )
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--impl {spec!r}: cannot import module {module_name!r}: {err}") from err
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--impl {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, KDAAdapter)):
        raise ValueError(f"--impl {spec!r}: {attr!r} is not a subclass of conformance.adapter.KDAAdapter")
    return cls
