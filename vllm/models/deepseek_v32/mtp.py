# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V3.2 / GLM-MoE-DSA MTP draft: the DeepSeek MTP layers with a V3.2 block (sparse MLA,
its own indexer), plus the switches that let draft steps 1.. reuse step 0's top-k indices."""

from __future__ import annotations

from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.model_executor.models.deepseek_mtp import (
    DeepSeekMTP,
    DeepSeekMultiTokenPredictor,
    DeepSeekMultiTokenPredictorLayer,
)
from vllm.models.deepseek_v32.model import (
    DeepseekV32DecoderLayer,
    DeepseekV32MLAAttention,
    check_dsa_config,
)


class DeepseekV32MultiTokenPredictorLayer(DeepSeekMultiTokenPredictorLayer):
    def __init__(
        self, config: Any, prefix: str, layer_idx: int, topk_indices_buffer: torch.Tensor | None
    ) -> None:
        block = DeepseekV32DecoderLayer(
            config, f"{prefix}.mtp_block", topk_indices_buffer, layer_idx=layer_idx
        )
        super().__init__(config, prefix, layer_idx, mtp_block=block)


class DeepseekV32MultiTokenPredictor(DeepSeekMultiTokenPredictor):
    """MTP layers whose indexers all write the target's top-k buffer, so a later draft step can
    read the selection step 0 left there. The draft allocates none of its own: draft loading
    points the indexers (the buffer's owners) at the target's, and the sparse attention impls
    see it through them (SharedTopkIndicesBuffer)."""

    def __init__(self, config: Any, prefix: str) -> None:
        check_dsa_config(config)
        super().__init__(
            config,
            prefix,
            layer_fn=lambda p, i: DeepseekV32MultiTokenPredictorLayer(config, p, i, None),
        )
        self.topk_indices_buffer: torch.Tensor | None = None

    def _attentions(self) -> list[DeepseekV32MLAAttention]:
        return [m for m in self.modules() if isinstance(m, DeepseekV32MLAAttention)]

    def set_skip_topk(self, skip: bool) -> None:
        """skip=True: the MTP layers' indexers do not run; attention reads the buffer as is."""
        for attn in self._attentions():
            attn.skip_topk = bool(skip)

    def compact_topk_indices(self, slot_ids: torch.Tensor) -> None:
        """Move row slot_ids[i] of every distinct top-k buffer to row i (each request's last
        prefill row becomes its row in the one-token-per-request decode steps)."""
        seen: set[int] = set()
        for attn in self._attentions():
            buf = attn.attn.topk_indices_buffer
            if buf is None or buf.data_ptr() in seen:
                continue
            seen.add(buf.data_ptr())
            idx = slot_ids.to(device=buf.device, dtype=torch.long)
            buf[: idx.numel()] = buf[idx]  # advanced indexing copies before the write


class DeepseekV32MTP(DeepSeekMTP):
    """MTP draft for DeepSeek-V3.2 and GLM-MoE-DSA checkpoints (SupportsPP, own embed_tokens
    and spec-layer weight names by inheritance from DeepSeekMTP)."""

    def _init_model(
        self, vllm_config: VllmConfig, config: Any, prefix: str
    ) -> DeepseekV32MultiTokenPredictor:
        return DeepseekV32MultiTokenPredictor(config, prefix)
