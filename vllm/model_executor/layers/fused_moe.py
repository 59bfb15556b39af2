# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reference mixture-of-experts in torch: top-k routing and the expert loop over stacked weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_linear: Callable[[torch.Tensor, int, str], torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]) for every token t.

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k] (any float dtype); topk_ids [T, k]. Each expert is a SwiGLU MLP. Only the
    experts that received tokens run, each once over all of its tokens. Returns [T, H] in the
    dtype of hidden_states, accumulated in float32. expert_linear(x, e, "w13" | "w2") computes
    x @ W[e]^T for weights stored otherwise than dense (quantized); by default F.linear.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    inter = w2.shape[2]
    if expert_linear is None:
        stacks = {"w13": w13, "w2": w2}

        def expert_linear(x: torch.Tensor, e: int, proj: str) -> torch.Tensor:
            return F.linear(x, stacks[proj][e])

    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        tokens = token_of[start : start + n]
        gate_up = expert_linear(hidden_states[tokens], expert, "w13")
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = expert_linear(act, expert, "w2")
        out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(hidden_states.dtype)


class UnquantizedFusedMoEMethod:
    """Dense stacked experts: w13_weight [E, 2I, H] (gate rows, then up) and w2_weight
    [E, H, I] in the compute dtype."""

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size
        layer.w13_weight = nn.Parameter(
            torch.empty(e, 2 * i, h, dtype=params_dtype), requires_grad=False
        )
        layer.w2_weight = nn.Parameter(
            torch.empty(e, h, i, dtype=params_dtype), requires_grad=False
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(
        self,
        layer: nn.Module,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return fused_moe(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style top-k routing; returns (topk_weights float32 [T, k], topk_ids [T, k]).

    scoring_func: "softmax" (DeepSeek-V2) or "sigmoid" (DeepSeek-V3). correction_bias (V3's
    e_score_correction_bias) shifts the scores used to choose experts but not the weights.
    With num_expert_group > 1 only the topk_group best groups are eligible; a group scores the
    sum of its two best biased scores when a correction bias is given (V3 "noaux_tc"), else its
    best score (V2 "group_limited_greedy").
    """
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        # Softmax scores are positive, so 0 excludes a group as -inf would (and matches HF V2).
        fill = float("-inf") if correction_bias is not None else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids
