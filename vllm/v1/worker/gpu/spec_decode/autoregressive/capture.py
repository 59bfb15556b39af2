# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The draft's warm-up in the shape of a verify step (AutoRegressiveSpeculator.capture)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.forward_context import ForwardContext
from vllm.v1.worker.gpu.sample.sampler import SamplingArrays
from vllm.v1.worker.gpu.spec_decode.autoregressive.draft_batch import DraftBatch

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
        AutoRegressiveSpeculator,
    )


def capture_verify_shape(spec: AutoRegressiveSpeculator) -> None:
    """Run the draft once at max_num_reqs with a dummy batch of K + 1 tokens per request,
    writing only into KV block 0 before any request exists."""
    R = spec.max_num_reqs
    q = max(1, min(spec.num_speculative_steps + 1, spec.max_num_tokens // R))
    T = R * q
    qsl = np.arange(R + 1, dtype=np.int64) * q
    positions = np.tile(np.arange(q, dtype=np.int64), R)
    block_table = np.zeros(
        (R, 1 + (q + spec.num_speculative_steps) // spec.block_size), dtype=np.int64
    )
    meta = build_attn_metadata(
        qsl,
        np.full(R, q),
        block_table,
        spec.block_size,
        spec.device,
        positions=positions,
        short_query_len=q,
    )
    h = torch.zeros(T, spec.target_hidden_size, dtype=spec.dtype, device=spec.device)
    n_aux = spec._num_aux_hidden_states()
    ids = np.zeros(T, dtype=np.int64)
    db = DraftBatch(
        slots=np.arange(R, dtype=np.int64),
        new_req=np.ones(R, dtype=bool),
        start=np.zeros(R, dtype=np.int64),
        last=np.full(R, q - 1, dtype=np.int64),
        last_token_indices=qsl[1:] - 1,
        query_start_loc=qsl,
        num_scheduled=np.full(R, q, dtype=np.int64),
        target_ids=ids,
        input_ids=ids,
        positions=positions,
        next_tokens=np.zeros((R, spec.num_lookahead_tokens), dtype=np.int64),
        num_known=np.full(R, q + 1, dtype=np.int64),
        block_table=block_table,
        attn_metadata=meta,
        sampling=SamplingArrays.greedy(R),
    )
    with torch.inference_mode():
        # The dummy verify layout: every row a decode row.
        layout = ForwardContext.laid_out_as(meta)
        hidden = spec.stage_hidden_states(spec._prefill_hidden(h, [h] * n_aux or None, layout))
        spec.last_token_indices.zero_()
        spec._draft(db, hidden)
