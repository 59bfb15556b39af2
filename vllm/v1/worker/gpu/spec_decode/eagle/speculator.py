# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EagleSpeculator: an EAGLE / EAGLE3 head drafting from the target's hidden states."""

from __future__ import annotations

import numpy as np
import torch

from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import HasDraftVocab, TargetShares
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
    AutoRegressiveSpeculator,
    DraftBatch,
)
from vllm.v1.worker.gpu.spec_decode.tree import StaticTree
from vllm.v1.worker.gpu.spec_decode.tree_draft import draft_dynamic, draft_tree


class EagleSpeculator(AutoRegressiveSpeculator):
    # Greedy drafting with a reduced draft vocabulary: argmax over the draft vocabulary and
    # map the winner through its draft -> target id map, instead of scattering every row into
    # a -inf target-vocab tensor each step (only a probabilistic draft, keyed by target token
    # id, needs that). None: the draft's logits are over the target vocabulary.
    draft_vocab: HasDraftVocab | None = None

    # speculative_token_tree: the drafts are that tree's nodes (spec_decode/tree_draft.py).
    tree: StaticTree | None = None
    # num_tree_nodes (a dynamic tree): the parents [R, K] of the last propose's rows' nodes.
    tree_parents: np.ndarray | None = None

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
            return self.draft_vocab.compute_draft_logits(hidden)
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
        self, db: DraftBatch, hidden_states: torch.Tensor, num_steps: int | None = None
    ) -> np.ndarray:
        spec = self.speculative_config
        if spec.num_tree_nodes is not None:
            assert spec.tree_top_k is not None and spec.tree_max_depth is not None
            drafts, self.tree_parents = draft_dynamic(
                self,
                db,
                hidden_states,
                spec.num_tree_nodes,
                spec.tree_top_k,
                spec.tree_max_depth,
                num_steps,
            )
            return drafts
        if self.tree is None:
            return super()._draft(db, hidden_states, num_steps)
        return draft_tree(self, db, hidden_states, self.tree, num_steps)
