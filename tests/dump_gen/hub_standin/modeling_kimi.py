"""Stand-in for the hub's `modeling_kimi.py` (moonshotai/Kimi-Linear-48B-A3B-Instruct), for the CPU tests of
the hf-hub reference. Written for the tests from a reading of the public file, not copied; it imports
nothing of this project.

What it keeps of the hub file, so that a change of transformers or fla that breaks the hub file breaks
the tests too:
- its import surface: the same third-party names from the same modules, `OutputRecorder` from
  `transformers.utils.generic` among them (moved in transformers 5.2: dump_gen's alias path), the fla
  names from `fla.layers.utils` (the flash-linear-attention package), `fla.modules` and `fla.ops.kda`,
  and its configuration by a relative import;
- its import-time calls: the transformers version check, `logging.get_logger`,
  `ALL_LAYERNORM_LAYERS.append`, `OutputRecorder(module_class, index=...)` in `_can_record_outputs`, the
  `check_model_inputs` / `auto_docstring` / `can_return_tuple` decorators on model forwards;
- the KDA layer's call sites: three `ShortConvolution`s called with `x=`, `cache=`,
  `output_final_state=`, `cu_seqlens=`; fla 0.4.0's `fused_kda_gate(g, A_log, head_dim, g_bias=dt_bias)`
  (which fails on fla's current gate unless dump_gen patches it); beta's sigmoid in fp32;
  `fused_recurrent_kda` for 64 tokens or fewer and `chunk_kda` above, with keywords;
  `FusedRMSNormGated(head_dim, eps=..., activation="sigmoid")`; the unpadding path of an attention mask;
  a `KimiDynamicCache` with `conv_states` and `recurrent_states`.
The model classes exist for their import-time calls only; the tests run the KDA layer.
"""

from typing import ClassVar

import torch
import transformers
from einops import rearrange
from fla.layers.utils import get_unpad_data, index_first_axis, pad_input
from fla.modules import FusedRMSNormGated, ShortConvolution
from fla.ops.kda import chunk_kda, fused_recurrent_kda
from fla.ops.kda.gate import fused_kda_gate
from packaging import version
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple, logging
from transformers.utils.generic import OutputRecorder, check_model_inputs

from .configuration_kimi import KimiLinearConfig

# Names the hub file imports for its attention and MoE classes, which this stand-in leaves out.
_IMPORTED_FOR_THE_FULL_MODEL = (
    ACT2FN,
    Cache,
    create_causal_mask,
    FlashAttentionKwargs,
    ALL_ATTENTION_FUNCTIONS,
)

if version.parse(transformers.__version__) < version.parse("4.56.0"):
    raise ImportError("the hub file asserts transformers >= 4.56.0")

logger = logging.get_logger(__name__)

RECURRENT_MAX_TOKENS = 64  # the hub layer's switch: fused_recurrent_kda up to here, chunk_kda above


class KimiDynamicCache:
    """Per layer: the three conv states (q, k, v) and the recurrent state of a KDA layer."""

    def __init__(self, config: KimiLinearConfig):
        self.config = config
        self.layer_types = [
            "linear_attention" if config.is_kda_layer(i) else "full_attention"
            for i in range(config.num_hidden_layers)
        ]
        self.conv_states: list[tuple[torch.Tensor, ...] | None] = [None] * config.num_hidden_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * config.num_hidden_layers


class KimiRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


ALL_LAYERNORM_LAYERS.append(KimiRMSNorm)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: KimiLinearConfig, layer_idx: int):
        super().__init__()
        linear = config.linear_attn_config
        self.layer_idx = layer_idx
        self.mode = "chunk"
        self.head_dim = linear["head_dim"]
        self.num_heads = linear["num_heads"]
        width = linear["short_conv_kernel_size"]
        hidden, proj = config.hidden_size, self.head_dim * self.num_heads
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d = ShortConvolution(hidden_size=proj, kernel_size=width, activation="silu")
        self.k_conv1d = ShortConvolution(hidden_size=proj, kernel_size=width, activation="silu")
        self.v_conv1d = ShortConvolution(hidden_size=proj, kernel_size=width, activation="silu")
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(proj))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, proj, bias=False)
        self.o_norm = FusedRMSNormGated(self.head_dim, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_params: KimiDynamicCache | None = None,
        **kwargs: Unpack[dict],
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        mode = "fused_recurrent" if q_len <= RECURRENT_MAX_TOKENS else self.mode
        if self.training and mode != "chunk":
            raise ValueError("training runs the chunk kernel only")
        cu_seqlens = kwargs.get("cu_seqlens")
        indices = None
        if attention_mask is not None:  # [batch, seq] of 0/1: drop the padding, pack the rest
            indices, cu_seqlens, _ = get_unpad_data(attention_mask[:, -q_len:])
            flat = rearrange(hidden_states, "b s ... -> (b s) ...")
            hidden_states = index_first_axis(flat, indices).unsqueeze(0)

        conv_states: tuple[torch.Tensor | None, ...] = (None, None, None)
        recurrent_state = None
        if cache_params is not None:
            conv_states = cache_params.conv_states[self.layer_idx] or conv_states
            recurrent_state = cache_params.recurrent_states[self.layer_idx]
        convolved = []
        for proj, conv, state in zip(
            (self.q_proj, self.k_proj, self.v_proj),
            (self.q_conv1d, self.k_conv1d, self.v_conv1d),
            conv_states,
        ):
            convolved.append(
                conv(
                    x=proj(hidden_states),
                    cache=state,
                    output_final_state=cache_params is not None,
                    cu_seqlens=cu_seqlens,
                )
            )
        (q, q_state), (k, k_state), (v, v_state) = convolved

        g = fused_kda_gate(
            self.f_b_proj(self.f_a_proj(hidden_states)), self.A_log, self.head_dim, g_bias=self.dt_bias
        )
        beta = self.b_proj(hidden_states).float().sigmoid()
        q, k, v = (rearrange(x, "... (h d) -> ... h d", d=self.head_dim) for x in (q, k, v))

        kernel = chunk_kda if mode == "chunk" else fused_recurrent_kda
        o, recurrent_state = kernel(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )
        if cache_params is not None:
            cache_params.recurrent_states[self.layer_idx] = recurrent_state
            cache_params.conv_states[self.layer_idx] = (q_state, k_state, v_state)

        gate = rearrange(self.g_b_proj(self.g_a_proj(hidden_states)), "... (h d) -> ... h d", d=self.head_dim)
        o = self.o_proj(rearrange(self.o_norm(o, gate), "b t h d -> b t (h d)"))
        if attention_mask is not None:
            o = pad_input(o.squeeze(0), indices, batch, q_len)
        return o


class KimiPreTrainedModel(PreTrainedModel):
    config_class = KimiLinearConfig
    base_model_prefix = "model"
    # The hub file records its MoE router's logits this way; here, the KDA layers' outputs.
    _can_record_outputs: ClassVar[dict[str, OutputRecorder]] = {
        "kda_outputs": OutputRecorder(KimiDeltaAttention, index=0)
    }


class KimiLinearModel(KimiPreTrainedModel):
    def __init__(self, config: KimiLinearConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(
            KimiDeltaAttention(config, i) for i in range(config.num_hidden_layers) if config.is_kda_layer(i)
        )

    @check_model_inputs
    @auto_docstring
    def forward(
        self, inputs_embeds: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> BaseModelOutputWithPast:
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


class KimiLinearForCausalLM(KimiPreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiLinearConfig):
        super().__init__(config)
        self.model = KimiLinearModel(config)

    @can_return_tuple
    @auto_docstring
    def forward(
        self, inputs_embeds: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=self.model(inputs_embeds=inputs_embeds).last_hidden_state)
