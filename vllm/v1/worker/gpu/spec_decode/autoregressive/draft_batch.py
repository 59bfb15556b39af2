# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DraftBatch: the target's step as an autoregressive draft sees it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm.attention.backends.torch_paged import AttentionMetadata
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays


@dataclass
class DraftBatch:
    """The target's step as the draft sees it (one entry per request unless noted)."""

    slots: np.ndarray  # request-state slot (indexes a draft's per-request bookkeeping)
    new_req: np.ndarray  # bool: the request entered its slot this step (nothing to carry)
    start: np.ndarray  # first position the target computed this step
    last: np.ndarray  # last valid (accepted) position
    last_token_indices: np.ndarray  # flat row of `last` in the target layout
    query_start_loc: np.ndarray  # [R + 1] the target layout
    num_scheduled: np.ndarray  # rows of each request in the target layout
    target_ids: np.ndarray  # [T] the target's input tokens
    input_ids: np.ndarray  # [num_tokens_padded] step 0's tokens (target's, shifted left)
    positions: np.ndarray  # [num_tokens_padded]
    next_tokens: np.ndarray  # [R, L] known tokens after `last` (first: its next token)
    num_known: np.ndarray  # known tokens of the sequence after this step
    block_table: np.ndarray  # [R, max_blocks]
    attn_metadata: AttentionMetadata  # the target's (step 0 reuses it)
    sampling: SamplingArrays
    # Step 0 rows whose input is an image placeholder, and the target's encoder outputs for
    # them (only where the binding decided the draft gathers them).
    mm_rows: np.ndarray | None = None
    mm_embeds: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.slots)

    def take(self, rows: np.ndarray) -> DraftBatch:
        """These requests only, for the draft passes after the first: the per-request fields
        sliced; the step's flat layout (query_start_loc, target_ids, input_ids, positions,
        attn_metadata, the multimodal rows) stays the whole step's, and last_token_indices
        still index it."""
        return replace(
            self,
            slots=self.slots[rows],
            new_req=self.new_req[rows],
            start=self.start[rows],
            last=self.last[rows],
            last_token_indices=self.last_token_indices[rows],
            num_scheduled=self.num_scheduled[rows],
            next_tokens=self.next_tokens[rows],
            num_known=self.num_known[rows],
            block_table=self.block_table[rows],
            sampling=self.sampling.take(rows),
        )
