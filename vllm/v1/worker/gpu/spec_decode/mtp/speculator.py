# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""MTPSpeculator: drafts with the multi-token-prediction layers shipped in the target checkpoint
(draft step s uses MTP layer s mod n), optionally sharing DSA top-k indices across steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from vllm.config import num_mtp_layers
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator
from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

if TYPE_CHECKING:
    from vllm.model_executor.models.base import DraftModelBase
    from vllm.models.deepseek_v32.mtp import DeepseekV32MultiTokenPredictor


class MTPSpeculator(AutoRegressiveSpeculator):
    # DeepSeek-V3.2: draft steps 1.. reuse step 0's sparse-attention top-k indices when the
    # draft config sets index_share_for_mtp_iteration and the draft can skip / compact them.
    share_mtp_topk_indices = False

    def load_draft_model(
        self, target_model: nn.Module, target_attn_layer_names: set[str]
    ) -> nn.Module:
        draft = load_eagle_model(target_model, self.vllm_config, self.device)
        inner = getattr(draft, "model", draft)
        cfg = self.draft_model_config.hf_text_config
        self.num_draft_layers = max(1, num_mtp_layers(cfg))
        self.share_mtp_topk_indices = (
            bool(getattr(cfg, "index_share_for_mtp_iteration", False))
            and hasattr(inner, "set_skip_topk")
            and hasattr(inner, "compact_topk_indices")
        )
        return draft

    def _forward_kwargs(self, draft_step: int) -> dict[str, Any]:
        return {"spec_step_idx": draft_step}

    def _compute_logits(self, hidden: torch.Tensor, draft_step: int) -> torch.Tensor:
        return cast("DraftModelBase", self.model).compute_logits(hidden, spec_step_idx=draft_step)

    @property
    def _inner(self) -> DeepseekV32MultiTokenPredictor:
        # Only read when share_mtp_topk_indices: the draft's inner predictor has the top-k hooks.
        return cast("DeepseekV32MultiTokenPredictor", getattr(self.model, "model", self.model))

    def on_prefill_begin(self, num_reqs: int) -> None:
        if self.share_mtp_topk_indices:
            # Unconditional: a step that failed half-way must not leave reuse switched on.
            self._inner.set_skip_topk(False)

    def on_prefill_end(self, num_reqs: int) -> None:
        # Step 1's rows continue step 0's rows topk_src_rows (one layer: each request's last
        # accepted row, last_token_indices).
        if self.share_mtp_topk_indices and self.num_speculative_steps > 1:
            self._inner.compact_topk_indices(self.topk_src_rows)

    def on_draft_rows_changed(self, num_reqs: int) -> None:
        if self.share_mtp_topk_indices:
            self._inner.compact_topk_indices(self.topk_src_rows)

    def on_multi_step_decode_begin(self, num_reqs: int) -> None:
        if self.share_mtp_topk_indices:
            self._inner.set_skip_topk(True)

    def on_multi_step_decode_end(self, num_reqs: int) -> None:
        if self.share_mtp_topk_indices:
            self._inner.set_skip_topk(False)
