# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""InputBatch: one step's flattened tokens and the layout the model and sampler need."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.attention.backends.torch_paged import AttentionMetadata, build_attn_metadata
from vllm.v1.worker.gpu.states import RequestStates


@dataclass
class InputBatch:
    req_ids: list[str]
    num_reqs: int
    idx_mapping_np: np.ndarray  # [R] batch row -> request-state slot
    num_scheduled_tokens: np.ndarray  # [R]
    num_tokens: int  # real tokens T
    # Rows the forward runs on (>= T: padded to a fixed shape); rows past T are padding that
    # attention, KV writes, linear-attention states and sampling never see.
    num_tokens_after_padding: int
    query_start_loc_np: np.ndarray  # [R + 1]
    seq_lens_np: np.ndarray  # [R]
    num_computed_tokens_np: np.ndarray  # [R] before this step
    prefill_len_np: np.ndarray  # [R] known tokens (history) of each request
    input_ids_np: np.ndarray  # [T]
    positions_np: np.ndarray  # [T]
    input_ids: torch.Tensor  # [num_tokens_after_padding] (padding: token 0)
    positions: torch.Tensor  # [num_tokens_after_padding] (padding: position 0)
    # Rows of the flattened batch whose logits are sampled: per request with a sample this step,
    # the last known token and each draft token after it (1 + num_drafts rows).
    logits_indices: torch.Tensor
    logits_indices_np: np.ndarray
    logits_req_np: np.ndarray  # [N] batch row of each logits row
    cu_num_logits_np: np.ndarray  # [R + 1]
    num_draft_tokens_np: np.ndarray  # [R]
    need_sample_np: np.ndarray  # [R] bool: not a non-final prefill chunk
    block_table_np: np.ndarray  # [R, max_blocks] each row's KV block ids
    attn_metadata: AttentionMetadata


def prepare_inputs(
    states: RequestStates,
    req_ids: list[str],
    num_scheduled: np.ndarray,
    block_size: int,
    device: torch.device,
    short_query_len: int,
    num_tokens_padded: int | None = None,
    scheduled_drafts: dict[str, int] | None = None,
) -> InputBatch:
    """Build the batch from the request states (before num_computed is advanced).
    num_tokens_padded: rows the forward runs on (default: the real token count).
    scheduled_drafts: the scheduler's count of drafts each request verifies (absent: none);
    the rows verify the first that many of the drafts stored in the request states, and a
    count that disagrees with the scheduled tokens is refused."""
    slots = np.array([states.slot(r) for r in req_ids], dtype=np.int64)
    n = np.asarray(num_scheduled, dtype=np.int64)
    c = states.num_computed[slots].copy()
    known = states.num_tokens[slots].copy()
    qsl = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(n, out=qsl[1:])
    T = int(qsl[-1])
    T_pad = T if num_tokens_padded is None else int(num_tokens_padded)
    if T_pad < T:
        raise ValueError(f"num_tokens_padded={T_pad} is smaller than the {T} scheduled tokens")
    row = np.repeat(np.arange(len(slots)), n)
    positions = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1], n) + c[row]
    slot_row = slots[row]
    hist = states.token_ids[slot_row, np.minimum(positions, states.token_ids.shape[1] - 1)]
    draft_j = positions - known[row]
    is_draft = draft_j >= 0
    if is_draft.any():
        drafts = states.draft_tokens[
            slot_row, np.clip(draft_j, 0, states.draft_tokens.shape[1] - 1)
        ]
        # A padded draft slot (no draft there) only runs when the scheduler verifies more
        # drafts than were proposed (the start-up step-cost measurement): any token will do.
        input_ids = np.where(is_draft, np.maximum(drafts, 0), hist)
    else:
        input_ids = hist
    seq_lens = c + n
    need_sample = seq_lens >= known
    num_drafts = np.where(need_sample, seq_lens - known, 0)
    if scheduled_drafts is not None and (scheduled_drafts or num_drafts.any()):
        want = np.fromiter((scheduled_drafts.get(r, 0) for r in req_ids), np.int64, len(req_ids))
        if (want != num_drafts).any():
            raise RuntimeError(
                f"the scheduler verifies {want.tolist()} drafts of requests {list(req_ids)}, "
                f"their scheduled tokens hold {num_drafts.tolist()}"
            )
    num_logits = np.where(need_sample, num_drafts + 1, 0)
    cu = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(num_logits, out=cu[1:])
    # The logits rows of a request are the last num_logits rows of its query.
    logits_req = np.repeat(np.arange(len(slots)), num_logits)
    logits_idx = (qsl[1:] - num_logits)[logits_req] + (np.arange(int(cu[-1])) - cu[:-1][logits_req])
    block_table = states.block_table[slots]
    slot_mapping = block_table[row, positions // block_size] * block_size + positions % block_size
    meta = build_attn_metadata(
        qsl,
        seq_lens,
        block_table,
        block_size,
        device,
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        positions=positions,
        short_query_len=short_query_len,
    )
    return InputBatch(
        req_ids=list(req_ids),
        num_reqs=len(req_ids),
        idx_mapping_np=slots,
        num_scheduled_tokens=n,
        num_tokens=T,
        num_tokens_after_padding=T_pad,
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        num_computed_tokens_np=c,
        prefill_len_np=known,
        input_ids_np=input_ids,
        positions_np=positions,
        input_ids=torch.from_numpy(_pad(input_ids, T_pad)).to(device),
        positions=torch.from_numpy(_pad(positions, T_pad)).to(device),
        logits_indices=torch.from_numpy(logits_idx).to(device),
        logits_indices_np=logits_idx,
        logits_req_np=logits_req,
        cu_num_logits_np=cu,
        num_draft_tokens_np=num_drafts,
        need_sample_np=need_sample,
        block_table_np=block_table,
        attn_metadata=meta,
    )


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    if len(x) == n:
        return x
    out = np.zeros(n, dtype=x.dtype)
    out[: len(x)] = x
    return out
