# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EagleSpeculator: an EAGLE / EAGLE3 head drafting from the target's hidden states."""

from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import ALL_SHORT
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import HasDraftVocab, TargetShares
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
    AutoRegressiveSpeculator,
    DraftBatch,
)
from vllm.v1.worker.gpu.spec_decode.tree import StaticTree
from vllm.v1.worker.gpu.spec_decode.tree_draft import propose_tree


class EagleSpeculator(AutoRegressiveSpeculator):
    # Greedy drafting with a reduced draft vocabulary: argmax over the draft vocabulary and
    # map the winner through its draft -> target id map, instead of scattering every row into
    # a -inf target-vocab tensor each step (only a probabilistic draft, keyed by target token
    # id, needs that). None: the draft's logits are over the target vocabulary.
    draft_vocab: HasDraftVocab | None = None

    # speculative_token_tree: the drafts are that tree's nodes (spec_decode/tree_draft.py).
    tree: StaticTree | None = None

    # One draft layer reading the target's hidden states: its first pass may wait while
    # nobody drafts (autoregressive/deferral.py).
    defers_first_pass = True

    def on_draft_bound(self, draft: DraftModel, shares: TargetShares) -> None:
        super().on_draft_bound(draft, shares)
        self.tree = StaticTree.from_config(self.vllm_config)
        if (
            self.draft_sample_method != "probabilistic"
            and isinstance(draft, HasDraftVocab)
            and draft.draft_to_target is not None
        ):
            self.draft_vocab = draft

    def _compute_logits(self, hidden: torch.Tensor, draft_step: int) -> torch.Tensor:
        if self.draft_vocab is not None:
            return self.draft_vocab.compute_draft_logits(hidden, ALL_SHORT)
        return super()._compute_logits(hidden, draft_step)

    def sample_draft(
        self, logits: torch.Tensor, positions: np.ndarray, sampling: SamplingArrays
    ) -> torch.Tensor:
        if self.draft_vocab is not None:
            d2t = self.draft_vocab.draft_to_target
            assert d2t is not None  # draft_vocab is only set with one
            return d2t[logits.argmax(-1)]
        return super().sample_draft(logits, positions, sampling)

    def _draft(
        self, db: DraftBatch, hidden_states: torch.Tensor, num_steps: int | np.ndarray | None = None
    ) -> np.ndarray:
        drafts = propose_tree(self, db, hidden_states, self.tree, num_steps)
        return super()._draft(db, hidden_states, num_steps) if drafts is None else drafts
