# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V2 / V3: multi-head latent attention (latent KV cache) and routed + shared experts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.attention.backends.mla.torch_mla import MLADims
from vllm.forward_context import ForwardContext
from vllm.model_executor.build_context import current_build_context
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from vllm.model_executor.layers.rotary_embedding import get_rope, rope_params, yarn_get_mscale
from vllm.model_executor.models.base import CausalLMBase, DecoderLayerBase, DecoderModelBase
from vllm.model_executor.models.llama import LlamaMLP


def get_spec_layer_idx_from_weight_name(config: Any, weight_name: str) -> int | None:
    """The MTP layer index L of a checkpoint weight `model.layers.{L}.*`, else None.

    MTP layers follow the decoder layers: num_hidden_layers <= L < num_hidden_layers +
    num_nextn_predict_layers.
    """
    num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if num_mtp <= 0 or not weight_name.startswith("model.layers."):
        return None
    idx = weight_name.split(".", 3)[2]
    if not idx.isdigit():
        return None
    layer = int(idx)
    first = int(config.num_hidden_layers)
    return layer if first <= layer < first + num_mtp else None


def _is_v2(config: Any) -> bool:
    return getattr(config, "model_type", None) == "deepseek_v2"


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Routed experts in this layer (also for MTP layers, whose index is >= num_hidden_layers)."""
    # V3.2 / GLM-DSA configs may spell the pattern out; MTP layers lie past its end.
    types = getattr(config, "mlp_layer_types", None)
    if types is not None and layer_idx < len(types):
        return types[layer_idx] == "sparse"
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    return (
        bool(getattr(config, "n_routed_experts", None))
        and layer_idx >= int(getattr(config, "first_k_dense_replace", 0) or 0)
        and layer_idx % freq == 0
    )


def _check_act(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for DeepSeek models (only 'silu')")


class DeepseekV2MoEGate(nn.Module):
    """Router weights; V3 ("noaux_tc") adds a per-expert bias used only to choose experts."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            # Kept in float32 whatever the model dtype (as HF does): it breaks near-ties.
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Router logits in float32 [T, E]."""
        return nn.functional.linear(hidden_states.float(), self.weight.float())


class DeepseekV2MoE(nn.Module):
    """Routed experts plus always-on shared experts (n_shared_experts * moe_intermediate_size)."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        _check_act(config)
        v2 = _is_v2(config)
        self.top_k = int(config.num_experts_per_tok)
        num_experts = int(config.n_routed_experts)
        # HF's V2/V3 configs lack these keys (the classes hard-code them); real checkpoints
        # spell them out: V2 softmax + greedy / group_limited_greedy, V3 sigmoid + noaux_tc.
        self.scoring_func = getattr(config, "scoring_func", None) or (
            "softmax" if v2 else "sigmoid"
        )
        topk_method = getattr(config, "topk_method", None) or ("greedy" if v2 else "noaux_tc")
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {topk_method!r} is not supported")
        grouped = topk_method != "greedy"
        self.num_expert_group = getattr(config, "n_group", None) if grouped else None
        self.topk_group = getattr(config, "topk_group", None) if grouped else None
        if self.num_expert_group and self.num_expert_group > 1:
            if num_experts % self.num_expert_group or not self.topk_group:
                raise ValueError(
                    f"n_routed_experts={num_experts} must split into n_group="
                    f"{self.num_expert_group} groups and topk_group must be set "
                    f"(got {self.topk_group!r})"
                )
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        # The group it was built for (a TP-1 draft: the trivial one).
        self.tp = current_build_context().tp
        self.gate = DeepseekV2MoEGate(config.hidden_size, num_experts, topk_method == "noaux_tc")
        # With TP every rank holds its slice of each expert's intermediate columns (and of the
        # shared experts'); the partial outputs are summed over the ranks once, in forward.
        self.experts = FusedMoE(num_experts, config.hidden_size, int(config.moe_intermediate_size))
        n_shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts: LlamaMLP | None = None
        if n_shared:
            self.shared_experts = LlamaMLP(
                config.hidden_size,
                int(config.moe_intermediate_size) * n_shared,
                bool(getattr(config, "mlp_bias", False)),
                reduce_results=False,
            )

    def forward(self, hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(
            self.gate(hidden_states),
            self.top_k,
            scoring_func=self.scoring_func,
            correction_bias=self.gate.e_score_correction_bias,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        out = self.experts(hidden_states, topk_weights, topk_ids, ctx.rows)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states, ctx)
        return self.tp.all_reduce(out)


def mla_softmax_scale(config: Any) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under scaled RoPE."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    _, scaling = rope_params(config)
    if scaling is not None:
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(float(scaling["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


class DeepseekV2MLAAttention(nn.Module):
    """MLA: queries (optionally low-rank), one shared latent kv_c plus a shared rotary key.
    With TP each rank runs num_attention_heads / TP heads (q_proj / q_b_proj and kv_b_proj
    split by heads, o_proj summed over the ranks); the latent projection and its cache are
    the same on every rank."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        total_heads = int(config.num_attention_heads)
        self.num_heads = divide(
            total_heads, current_build_context().tp.world_size, "num_attention_heads"
        )
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, total_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=bias)
            # HF and the reference code use the default eps (not rms_norm_eps) for the latents.
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, total_heads * qk_head_dim, bias=False
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            total_heads * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False,
        )
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, h, bias=bias)
        theta, scaling = rope_params(config)
        # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)...; V2 always, V3 unless the
        # checkpoint's rope_interleave is false. q_pe and k_pe share the layout, so their dot
        # products equal HF's whichever order HF writes the rotated pairs in.
        interleaved = True if _is_v2(config) else bool(getattr(config, "rope_interleave", True))
        self.rotary_emb = get_rope(
            self.qk_rope_head_dim,
            self.qk_rope_head_dim,
            int(config.max_position_embeddings),
            theta,
            is_neox_style=not interleaved,
            scaling=scaling,
        )
        self.attn = MLAAttention(self.mla_dims(config), self.kv_b_proj, prefix=f"{prefix}.attn")

    def mla_dims(self, config: Any) -> MLADims:
        """The sizes of this block's MLA attention layer (dense or sparse)."""
        return MLADims(
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            mla_softmax_scale(config),
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe, _ = self.project(positions, hidden_states, ctx)
        return self.o_proj(self.attn(q_nope, q_pe, kv_c, k_pe, ctx), ctx.rows)

    def project(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_nope, rotated q_pe, normed kv_c, rotated k_pe, q latent or None without q LoRA)."""
        rows = ctx.rows
        q_c = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states, rows)
        else:
            q_c = self.q_a_layernorm(self.q_a_proj(hidden_states, rows))
            q = self.q_b_proj(q_c, rows)
        q = q.view(q.shape[0], self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states, rows).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        return q_nope, q_pe, kv_c, k_pe, q_c


class DeepseekV2DecoderLayer(DecoderLayerBase):
    """One decoder block; layer_idx may be an MTP layer's (>= num_hidden_layers)."""

    def __init__(
        self,
        config: Any,
        prefix: str,
        layer_idx: int | None = None,
        self_attn: nn.Module | None = None,
    ) -> None:
        """self_attn: a prebuilt attention block (V3.2 passes its sparse one), else plain MLA."""
        super().__init__()
        if layer_idx is None:
            layer_idx = int(prefix.rsplit(".", 1)[-1])
        self.layer_idx = layer_idx
        eps = getattr(config, "rms_norm_eps", 1e-6)
        if self_attn is None:
            self_attn = DeepseekV2MLAAttention(config, prefix=f"{prefix}.self_attn")
        self.self_attn = self_attn
        self.mlp: nn.Module
        if is_moe_layer(config, layer_idx):
            self.mlp = DeepseekV2MoE(config, prefix=f"{prefix}.mlp")
        else:
            _check_act(config)
            self.mlp = LlamaMLP(
                config.hidden_size,
                int(config.intermediate_size),
                bool(getattr(config, "mlp_bias", False)),
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class DeepseekV2Model(DecoderModelBase):
    def make_layer(self, layer_idx: int, prefix: str) -> nn.Module:
        return DeepseekV2DecoderLayer(self.config, prefix, layer_idx=layer_idx)


class DeepseekV2ForCausalLM(CausalLMBase):
    """DeepSeek-V2 causal LM (MLA + MoE); supports tensor and pipeline parallelism."""

    model_cls = DeepseekV2Model
    supports_tp = True

    def skip_weight(self, name: str) -> bool:
        # MTP layers (model.layers.{N+i}) are the MTP drafter's.
        return get_spec_layer_idx_from_weight_name(
            self.config, name
        ) is not None or super().skip_weight(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 causal LM: sigmoid routing with e_score_correction_bias (from the config)."""
