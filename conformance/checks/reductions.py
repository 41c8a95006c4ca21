"""Which fp32 reduction is the widest behind each check's result: the K of its rounding budget
(`conformance.judging.reduction`).

The projections reduce over the hidden size (q, k, v, the gate's and beta's inputs, the output gate;
the low-rank second projections reduce over D, less); the output projection over P = H·D; the kernels
over a head's D channels and the chunk's tokens. A stage's budget is that of the widest reduction on its
path from the layer's input: the states and `o_norm` carry the projections' (hidden), the layer output
(and its decode, chunked-prefill and serving replays, and the long cases by position) the wider of
hidden and P. A kernel check runs on the dump's own inputs, so its budget is the kernel's alone, and so
does `layer-kernel-state`, on the layer's own kernel inputs: a chunk kernel's, as the layer's is. The
layer's backward reduces over all of these, and a weight's gradient over the case's tokens too (`A_log`'s
over every channel of a head's tokens, `o_norm`'s over every head's).
"""

from __future__ import annotations

from conformance.checks.kinds import LAYER_GRAD_WEIGHT, LAYER_GRADIENT_TRUTH, OWN_INPUTS_TRUTH, CheckKind
from conformance.judging.reduction import Reduction
from kda_spec.config import KDAConfig

# The chunk length of the reference's chunk kernel (fla's chunk_kda): its intra-chunk sums have this many
# terms. An implementation's own chunk may be shorter (kda_impl's is 32); the budget is the reference's.
REFERENCE_CHUNK_TOKENS = 64


def reduction_of(kind: CheckKind, config: KDAConfig, tokens: int = 0, arg: str | None = None) -> Reduction:
    """The widest fp32 reduction behind the result of a check of `kind` (and argument `arg`) under
    `config` on a case of `tokens` tokens (module docstring): a kernel's own, a layer gradient's, else by
    the layer result the kind is judged as (`CheckKind.result`)."""
    hidden, proj, dim = config.hidden_size, config.proj_dim, config.head_dim
    if kind.truth == LAYER_GRADIENT_TRUTH:
        widest = {
            "the projections over hidden": hidden, "o_proj's and the projections' transposes over P": proj,
            f"the chunk kernel's {REFERENCE_CHUNK_TOKENS}-token chunks": REFERENCE_CHUNK_TOKENS,
        }  # fmt: skip
        if kind == LAYER_GRAD_WEIGHT:  # a weight's gradient sums over every token, some over more
            per_token = {"A_log": (dim, "channels of a head"), "o_norm": (config.num_heads, "heads")}
            terms, what = per_token.get(arg or "", (1, ""))
            over = f"the weight's sum over the case's tokens{' and ' + what if what else ''}"
            widest[over] = tokens * terms
        what, length = max(widest.items(), key=lambda item: item[1])
        return Reduction(length, f"the layer's backward: {what} ({length})")
    if kind.kernel == "chunk" or kind.truth == OWN_INPUTS_TRUTH:  # a layer's kernel is a chunk kernel
        length = max(dim, REFERENCE_CHUNK_TOKENS)
        return Reduction(length, f"the chunk kernel: D={dim} channels, {REFERENCE_CHUNK_TOKENS}-token chunks")
    if kind.kernel is not None:
        return Reduction(dim, f"the recurrent kernel: D={dim} channels")
    if kind.result == "out":
        length = max(hidden, proj)
        return Reduction(length, f"the projections over hidden={hidden} and o_proj over P={proj}")
    return Reduction(hidden, f"the projections over hidden={hidden}")
