# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V3.2 / GLM-MoE-DSA MTP draft: the DeepSeek MTP layers with a V3.2 block (sparse MLA,
its own indexer), bound to its target's top-k buffer, plus the switches that let draft steps 1..
reuse step 0's top-k indices (SupportsTopkSharing)."""

from __future__ import annotations

from typing import Any

import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.models.deepseek_mtp import (
    DeepSeekMTP,
    DeepSeekMultiTokenPredictor,
    DeepSeekMultiTokenPredictorLayer,
)
from vllm.model_executor.models.interfaces import SupportsTopkSharing, TargetShares
from vllm.models.deepseek_v32.model import (
    DeepseekV32DecoderLayer,
    DeepseekV32MLAAttention,
    check_dsa_config,
)


class DeepseekV32MultiTokenPredictorLayer(DeepSeekMultiTokenPredictorLayer):
    def __init__(self, config: Any, prefix: str, layer_idx: int) -> None:
        # No buffer of its own: binding to the target gives it the target's.
        block = DeepseekV32DecoderLayer(config, f"{prefix}.mtp_block", None, layer_idx=layer_idx)
        super().__init__(config, prefix, layer_idx, mtp_block=block)

    @property
    def attention(self) -> DeepseekV32MLAAttention:
        attn = self.mtp_block.get_submodule("self_attn")
        assert isinstance(attn, DeepseekV32MLAAttention)
        return attn


class DeepseekV32MultiTokenPredictor(DeepSeekMultiTokenPredictor):
    """MTP layers whose indexers all write the target's top-k buffer (bound after loading), so
    a later draft step can read the selection step 0 left there."""

    def __init__(self, config: Any, prefix: str) -> None:
        check_dsa_config(config)
        super().__init__(
            config, prefix, layer_fn=lambda p, i: DeepseekV32MultiTokenPredictorLayer(config, p, i)
        )

    def attentions(self) -> list[DeepseekV32MLAAttention]:
        return [
            layer.attention
            for layer in self.mtp_layers()
            if isinstance(layer, DeepseekV32MultiTokenPredictorLayer)
        ]


class DeepseekV32MTP(DeepSeekMTP, SupportsTopkSharing):
    """MTP draft for DeepSeek-V3.2 and GLM-MoE-DSA checkpoints (SupportsPP, own embed_tokens
    and spec-layer weight names by inheritance from DeepSeekMTP)."""

    model: DeepseekV32MultiTokenPredictor

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> DeepseekV32MultiTokenPredictor:
        return DeepseekV32MultiTokenPredictor(self.config, prefix)

    def bind_target(self, shares: TargetShares) -> None:
        """Also select into and attend from the target's top-k buffer (the draft has none)."""
        buf = shares.topk_indices_buffer
        if buf is None:
            raise RuntimeError(
                f"{type(self).__name__} needs its target's top-k indices buffer, and the target "
                "offers none (it is not a DeepSeek-V3.2-style sparse-attention model)"
            )
        super().bind_target(shares)
        for attn in self.model.attentions():
            attn.use_topk_indices_buffer(buf)

    @property
    def shares_topk_across_steps(self) -> bool:
        return bool(getattr(self.config, "index_share_for_mtp_iteration", False))

    def set_skip_topk(self, skip: bool) -> None:
        for attn in self.model.attentions():
            attn.skip_topk = bool(skip)

    def compact_topk_indices(self, rows: torch.Tensor) -> None:
        # Every layer reads the one buffer its binding gave it.
        buf = self.bound_shares.topk_indices_buffer if self.bound_shares is not None else None
        if buf is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to its target yet")
        idx = rows.to(device=buf.device, dtype=torch.long)
        buf[: idx.numel()] = buf[idx]  # advanced indexing copies before the write
