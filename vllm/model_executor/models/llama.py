# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Llama (and, with qkv bias, Qwen2): GQA attention with RoPE, SwiGLU MLP, RMSNorm."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vllm.forward_context import ForwardContext
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import get_rope, rope_params
from vllm.model_executor.models.base import CausalLMBase, DecoderLayerBase, DecoderModelBase
from vllm.model_executor.models.interfaces import SupportsEagle3


class LlamaMLP(nn.Module):
    """SwiGLU MLP with gate and up packed into one projection (gate_up_proj); with TP each
    rank holds its slice of the intermediate columns, down_proj sums the ranks' parts."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        reduce_results: bool = True,
    ) -> None:
        """reduce_results=False leaves the sum over TP ranks to the caller (a MoE block sums
        its shared and routed experts' partial outputs first, then reduces once)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, ("gate_proj", "up_proj"), bias=bias
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rows = ctx.rows
        return self.down_proj(self.act_fn(self.gate_up_proj(x, rows)), rows)


class LlamaAttention(nn.Module):
    """GQA attention with RoPE; q, k and v packed into one projection (qkv_proj).
    input_size: width of what the projection reads (default hidden_size; EAGLE3's draft
    layer reads twice that). With TP each rank runs num_heads / TP query heads and its KV
    heads (one shared head when there are fewer KV heads than ranks)."""

    def __init__(
        self, config: Any, qkv_bias: bool, prefix: str, input_size: int | None = None
    ) -> None:
        super().__init__()
        h = config.hidden_size
        total_heads = int(config.num_attention_heads)
        total_kv = int(getattr(config, "num_key_value_heads", None) or total_heads)
        self.head_dim = getattr(config, "head_dim", None) or h // total_heads
        o_bias = bool(getattr(config, "attention_bias", False)) and not qkv_bias
        self.qkv_proj = QKVParallelLinear(
            input_size or h, self.head_dim, total_heads, total_kv, bias=qkv_bias
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, h, bias=o_bias)
        theta, scaling = rope_params(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            self.head_dim,
            int(config.max_position_embeddings),
            theta,
            is_neox_style=True,
            scaling=scaling,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        rows = ctx.rows
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states, rows))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx), rows)


class LlamaDecoderLayer(DecoderLayerBase):
    def __init__(self, config: Any, qkv_bias: bool, prefix: str) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, qkv_bias, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class LlamaModel(DecoderModelBase):
    """The Llama decoder; its EAGLE3 taps travel over pipeline stages."""

    qkv_bias: ClassVar[bool] = False
    supports_aux_hidden_states_over_pp = True

    def make_layer(self, layer_idx: int, prefix: str) -> nn.Module:
        return LlamaDecoderLayer(self.config, self.qkv_bias, prefix)


class LlamaForCausalLM(CausalLMBase, SupportsEagle3):
    """Llama causal LM; supports tensor and pipeline parallelism and EAGLE3 aux hidden
    states."""

    model_cls = LlamaModel
    supports_tp = True
