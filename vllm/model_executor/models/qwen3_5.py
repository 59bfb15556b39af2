# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Qwen3.5 (dense and MoE), text path: a hybrid of Gated DeltaNet linear-attention layers (per
request conv + recurrent state) and gated full-attention layers (q/k norm, partial rotary, a
sigmoid output gate), chosen per layer by config.layer_types."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm.forward_context import ForwardContext
from vllm.logger import init_logger
from vllm.model_executor.build_context import current_build_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPSharded,
    divide,
    shard_packed_rows,
)
from vllm.model_executor.layers.mamba import MambaBase
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_varlen
from vllm.model_executor.layers.mamba.ops.gated_delta_rule import (
    gated_delta_rule_varlen,
    l2norm,
)
from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding, rope_params
from vllm.model_executor.models.base import CausalLMBase, DecoderLayerBase, DecoderModelBase
from vllm.model_executor.models.llama import LlamaMLP

logger = init_logger(__name__)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


def _check_config(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Qwen3.5: hidden_act {act!r} is not supported (only 'silu')")
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) < int(config.num_hidden_layers):
        raise ValueError(
            f"Qwen3.5: config.layer_types has {len(types)} entries for "
            f"{config.num_hidden_layers} layers"
        )
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"Qwen3.5: unknown layer_types {unknown}")


class Qwen3_5RMSNorm(RMSNorm):
    """Zero-centred RMSNorm: the weight stores (scale - 1); applied in float32."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Qwen3_5RMSNormGated(nn.Module):
    """RMSNorm over the last dim, then times silu(gate) (the Gated DeltaNet output norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class _ShardedConv1d(nn.Conv1d, TPSharded):
    """The depthwise conv over the packed [q; k; v] channels: each rank holds its part of
    each (as in_proj_qkv's rows), so its conv state is per rank too."""

    def __init__(self, packed_sizes: list[int], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed_sizes = packed_sizes
        tp = current_build_context().tp
        self.tp_rank, self.tp_size = tp.rank, tp.world_size

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_packed_rows(tensor, self.packed_sizes, self.tp_rank, self.tp_size)


class Qwen3_5GatedDeltaNet(MambaBase, TPSharded):
    """Linear attention: causal depthwise conv over [q; k; v], then the gated delta rule with
    a per-head decay and step size, then a gated RMSNorm and the output projection. With TP
    each rank runs linear_num_key_heads / TP key heads and their value heads (projections,
    conv channels, decay and step parameters, conv and recurrent states split by heads);
    out_proj sums the ranks' parts."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__(prefix)
        h = config.hidden_size
        tp = current_build_context().tp
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        total_k = int(config.linear_num_key_heads)
        total_v = int(config.linear_num_value_heads)
        self.head_k_dim = int(config.linear_key_head_dim)
        self.head_v_dim = int(config.linear_value_head_dim)
        if total_v % total_k:
            raise ValueError(
                f"Qwen3.5: linear_num_value_heads={total_v} is not a multiple of "
                f"linear_num_key_heads={total_k}"
            )
        self.num_k_heads = divide(total_k, self.tp_size, "linear_num_key_heads")
        self.num_v_heads = divide(total_v, self.tp_size, "linear_num_value_heads")
        total_key_dim, total_value_dim = total_k * self.head_k_dim, total_v * self.head_v_dim
        packed = [total_key_dim, total_key_dim, total_value_dim]
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = int(config.linear_conv_kernel_dim)
        if self.conv_kernel_size < 2:
            raise ValueError(
                f"Qwen3.5: linear_conv_kernel_dim must be >= 2, got {self.conv_kernel_size}"
            )
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.in_proj_qkv = ColumnParallelLinear(h, sum(packed), bias=False, packed_sizes=packed)
        self.in_proj_z = ColumnParallelLinear(h, total_value_dim, bias=False)
        self.in_proj_b = ColumnParallelLinear(h, total_v, bias=False)
        self.in_proj_a = ColumnParallelLinear(h, total_v, bias=False)
        self.conv1d = _ShardedConv1d(
            packed,
            self.conv_dim,
            self.conv_dim,
            self.conv_kernel_size,
            groups=self.conv_dim,
            bias=False,
            padding=self.conv_kernel_size - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = Qwen3_5RMSNormGated(self.head_v_dim, eps)
        self.out_proj = RowParallelLinear(total_value_dim, h, bias=False)

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        # dt_bias / A_log: one entry per value head.
        n = self.num_v_heads
        if self.tp_size == 1 or tensor.dim() != 1 or tensor.shape[0] != n * self.tp_size:
            return tensor
        return tensor.narrow(0, self.tp_rank * n, n)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [
            (self.conv_dim, self.conv_kernel_size - 1),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        ]

    def state_dtypes(self, model_dtype: torch.dtype) -> list[torch.dtype]:
        # The recurrence runs in float32; keeping its state in float32 avoids drift over long
        # sequences in half-precision models.
        return [model_dtype, torch.float32]

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.linear_attn_metadata
        T = hidden_states.shape[0]
        if self.states is None or meta is None:
            # Without states (no cache bound yet) there is nothing to attend over.
            return torch.zeros_like(hidden_states)
        x = hidden_states[: meta.num_tokens]
        n = meta.num_tokens
        conv_state, recurrent_state = self.states
        conv_ckpt, recurrent_ckpt = self.checkpoints or (None, None)
        rows = ctx.rows
        mixed = causal_conv1d_varlen(
            self.in_proj_qkv(x, rows), self.conv1d.weight, None, conv_state, meta, "silu", conv_ckpt
        )
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(n, self.num_k_heads, self.head_k_dim).float())
        q = q * self.head_k_dim**-0.5
        k = l2norm(k.reshape(n, self.num_k_heads, self.head_k_dim).float())
        rep = self.num_v_heads // self.num_k_heads
        if rep > 1:
            # Each q/k head serves `rep` consecutive value heads.
            q = q.repeat_interleave(rep, dim=1)
            k = k.repeat_interleave(rep, dim=1)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim).float()
        beta = self.in_proj_b(x, rows).float().sigmoid()
        a = self.in_proj_a(x, rows).float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        o = gated_delta_rule_varlen(q, k, v, g, beta, recurrent_state, meta, recurrent_ckpt)
        z = self.in_proj_z(x, rows).reshape(n, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.to(x.dtype), z).reshape(n, self.value_dim)
        out = self.out_proj(o, rows)
        if n == T:
            return out
        return torch.cat([out, out.new_zeros(T - n, out.shape[1])], dim=0)


class Qwen3_5Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm, partial rotary, and a sigmoid output gate
    produced by q_proj next to each query head."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        total_heads = int(config.num_attention_heads)
        total_kv = int(getattr(config, "num_key_value_heads", None) or total_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or h // total_heads)
        bias = bool(getattr(config, "attention_bias", False))
        eps = getattr(config, "rms_norm_eps", 1e-6)
        # q_proj holds each head's query and gate rows next to each other: twice the width,
        # split by heads like k and v (KV heads replicated when fewer than the ranks).
        self.qkv_proj = QKVParallelLinear(
            h, self.head_dim, total_heads, total_kv, bias=bias, q_head_size=2 * self.head_dim
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, h, bias=bias)
        self.q_norm = Qwen3_5RMSNorm(self.head_dim, eps)
        self.k_norm = Qwen3_5RMSNorm(self.head_dim, eps)
        theta, scaling = rope_params(config)
        params = getattr(config, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        rotary_dim = int(self.head_dim * float(factor))
        # Multimodal positions [3, T] rotate by axis (HF's default sections when the config
        # names none); text positions [T] are plain RoPE.
        self.rotary_emb = MRotaryEmbedding(
            self.head_dim,
            rotary_dim,
            int(config.max_position_embeddings),
            theta,
            list(params.get("mrope_section", None) or [11, 11, 10]),
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
        T = hidden_states.shape[0]
        rows = ctx.rows
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states, rows))
        q, gate = q_gate.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).reshape(T, -1)
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)).reshape(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, ctx) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out, rows)


class Qwen3_5MoeSparseMoeBlock(nn.Module):
    """Softmax top-k routing (renormalised) over the experts, plus a shared expert scaled by a
    sigmoid gate."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k = int(config.num_experts_per_tok)
        num_experts = int(config.num_experts)
        # The group it was built for (a TP-1 draft: the trivial one).
        self.tp = current_build_context().tp
        self.gate = nn.Linear(h, num_experts, bias=False)
        # With TP: each expert's and the shared expert's columns split; one all-reduce.
        self.experts = FusedMoE(num_experts, h, int(config.moe_intermediate_size))
        self.shared_expert = LlamaMLP(
            h, int(config.shared_expert_intermediate_size), reduce_results=False
        )
        self.shared_expert_gate = ReplicatedLinear(h, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rows = ctx.rows
        topk_weights, topk_ids = select_experts(
            self.gate(hidden_states), self.top_k, scoring_func="softmax", renormalize=True
        )
        out = self.experts(hidden_states, topk_weights.to(hidden_states.dtype), topk_ids, rows)
        shared = self.shared_expert(hidden_states, ctx)
        out = out + torch.sigmoid(self.shared_expert_gate(hidden_states, rows)) * shared
        return self.tp.all_reduce(out)


class Qwen3_5DecoderLayer(DecoderLayerBase):
    def __init__(self, config: Any, layer_type: str, prefix: str, moe: bool = False) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.layer_type = layer_type
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = Qwen3_5GatedDeltaNet(config, prefix=f"{prefix}.linear_attn")
        elif layer_type == FULL_ATTENTION:
            self.self_attn = Qwen3_5Attention(config, prefix=f"{prefix}.self_attn")
        else:
            raise ValueError(f"Qwen3.5: unknown layer type {layer_type!r}")
        self.mlp: nn.Module
        if moe:
            self.mlp = Qwen3_5MoeSparseMoeBlock(config)
        else:
            self.mlp = LlamaMLP(config.hidden_size, int(config.intermediate_size))
        self.input_layernorm = Qwen3_5RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Qwen3_5RMSNorm(config.hidden_size, eps)

    def mix(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if self.layer_type == LINEAR_ATTENTION:
            return self.linear_attn(hidden_states, ctx)
        return self.self_attn(positions, hidden_states, ctx)


class Qwen3_5Model(DecoderModelBase):
    moe: ClassVar[bool] = False
    norm_cls = Qwen3_5RMSNorm

    def validate_config(self, config: Any) -> None:
        _check_config(config)

    def make_layer(self, layer_idx: int, prefix: str) -> nn.Module:
        return Qwen3_5DecoderLayer(
            self.config, self.config.layer_types[layer_idx], prefix, moe=self.moe
        )


class Qwen3_5MoeModel(Qwen3_5Model):
    moe = True


_VISION_PREFIXES = ("model.visual.", "visual.")


class Qwen3_5ForCausalLM(CausalLMBase):
    """Qwen3.5 causal LM (also the text path of Qwen3_5ForConditionalGeneration checkpoints,
    whose `model.language_model.*` weights load here and whose vision weights are skipped)."""

    model_cls = Qwen3_5Model
    supports_tp = True
    skip_prefixes = ("mtp.",)  # the MTP draft (qwen3_5_mtp.py) loads these
    hf_to_vllm_prefix = {"model.language_model.": "model."}
    _skipped_vision = 0

    def skip_weight(self, name: str) -> bool:
        if name.startswith(_VISION_PREFIXES):
            self._skipped_vision += 1
            return True
        return super().skip_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._skipped_vision = 0
        loaded = super().load_weights(weights)
        if self._skipped_vision:
            logger.info(
                "%s: skipped %d vision-encoder weights (only the text path is supported)",
                type(self).__name__,
                self._skipped_vision,
            )
        return loaded


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP is a routed MoE with a gated shared expert."""

    model_cls = Qwen3_5MoeModel
