# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""MTPSpeculator: drafts with the multi-token-prediction layers shipped in the target checkpoint
(draft step s uses MTP layer s mod n), optionally sharing DSA top-k indices across steps."""

from __future__ import annotations

from vllm.config import num_mtp_layers
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import SupportsTopkSharing, TargetShares
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator


class MTPSpeculator(AutoRegressiveSpeculator):
    # DeepSeek-V3.2: the draft whose steps 1.. reuse step 0's sparse-attention top-k indices
    # (its config sets index_share_for_mtp_iteration); None: every step selects its own.
    topk_sharing: SupportsTopkSharing | None = None

    @property
    def share_mtp_topk_indices(self) -> bool:
        return self.topk_sharing is not None

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        super().on_draft_bound(draft, shares)
        self.num_draft_layers = max(1, num_mtp_layers(self.draft_model_config.hf_text_config))
        if isinstance(draft, SupportsTopkSharing) and draft.shares_topk_across_steps:
            self.topk_sharing = draft

    def on_prefill_begin(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            # Unconditional: a step that failed half-way must not leave reuse switched on.
            self.topk_sharing.set_skip_topk(False)

    def on_prefill_end(self, num_reqs: int) -> None:
        # Step 1's rows continue step 0's rows topk_src_rows (one layer: each request's last
        # accepted row, last_token_indices).
        if self.topk_sharing is not None and self.num_speculative_steps > 1:
            self.topk_sharing.compact_topk_indices(self.topk_src_rows)

    def on_draft_rows_changed(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            self.topk_sharing.compact_topk_indices(self.topk_src_rows)

    def on_multi_step_decode_begin(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            self.topk_sharing.set_skip_topk(True)

    def on_multi_step_decode_end(self, num_reqs: int) -> None:
        if self.topk_sharing is not None:
            self.topk_sharing.set_skip_topk(False)
