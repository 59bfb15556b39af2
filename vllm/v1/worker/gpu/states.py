# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Per-request state kept on the worker in persistent slots (the V2 model runner's layout).

A request keeps its slot from the step it enters the batch until it finishes or is preempted, so
token history, block table and sampling parameters are written once, not rebuilt every step.
What the last pipeline stage decides for a batch (StepResult) is applied to these states by one
function, apply_step_result, on every stage.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData


class RequestStates:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_spec: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.num_spec = num_spec
        self.req_id_to_slot: dict[str, int] = {}
        self.slot_req_id: list[str | None] = [None] * max_num_reqs
        self._free: deque[int] = deque(range(max_num_reqs))
        width = max_model_len + num_spec + 1
        self.token_ids = np.zeros((max_num_reqs, width), dtype=np.int64)  # prompt + sampled
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # length of token_ids history
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Hybrid models: the KV cache manager's linear-attention state slot (-1: none).
        self.state_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self.draft_tokens = np.zeros((max_num_reqs, max(num_spec, 1)), dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -2, dtype=np.int64)  # -2: none requested
        self.num_prompt_logprobs = np.full(max_num_reqs, -2, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        # np.zeros maps fresh pages that become resident only when written: write the big
        # tables now, so a stage's memory after start-up is what it keeps.
        self.token_ids.fill(0)
        self.block_table.fill(0)

    def nbytes(self) -> int:
        """Memory of the per-slot arrays (the start-up log reports it)."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

    def slot(self, req_id: str) -> int:
        return self.req_id_to_slot[req_id]

    def add(self, data: NewRequestData) -> int:
        if data.req_id in self.req_id_to_slot:
            raise RuntimeError(f"request {data.req_id} added twice")
        s = self._free.popleft()
        self.req_id_to_slot[data.req_id] = s
        self.slot_req_id[s] = data.req_id
        toks = data.prefill_token_ids
        self.token_ids[s, : len(toks)] = toks
        self.num_tokens[s] = len(toks)
        self.num_computed[s] = data.num_computed_tokens
        self.num_prompt[s] = data.num_prompt_tokens
        self.state_slot[s] = data.state_slot
        self.num_blocks[s] = 0
        self.append_blocks(s, data.block_ids)
        p = data.sampling_params
        self.params[s] = p
        self.temperature[s] = p.temperature
        self.top_k[s] = p.top_k
        self.top_p[s] = p.top_p
        self.min_p[s] = p.min_p
        self.seed[s] = data.seed
        self.num_logprobs[s] = -2 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[s] = -2 if p.prompt_logprobs is None else p.prompt_logprobs
        self.min_tokens[s] = p.min_tokens
        return s

    def append_blocks(self, s: int, block_ids: list[int]) -> None:
        n = int(self.num_blocks[s])
        self.block_table[s, n : n + len(block_ids)] = block_ids
        self.num_blocks[s] = n + len(block_ids)

    def remove(self, req_id: str) -> int | None:
        s = self.req_id_to_slot.pop(req_id, None)
        if s is None:
            return None
        self.slot_req_id[s] = None
        self.params[s] = None
        self._free.append(s)
        return s


# Fills the unused tail of a StepResult row (its width never depends on how many drafts were
# accepted).
PAD_TOKEN_ID = -1


@dataclass
class StepResult:
    """What the last pipeline stage decided for one batch, one row per batch row: the tokens
    it sampled (accepted drafts, then the target's own token), how many drafts it rejected, and
    the drafts it proposed for the next step. Every stage applies it with apply_step_result."""

    sampled: np.ndarray  # [R, K + 1] int64; row i holds num_sampled[i] tokens, then PAD_TOKEN_ID
    num_sampled: np.ndarray  # [R] int64; 0 for a non-final prefill chunk
    num_rejected: np.ndarray  # [R] int64; 0 where nothing was sampled
    drafts: np.ndarray | None  # [R, K] int64, or None without speculation
    # A dynamic draft tree's node parents (-1: the root) [R, K] int64: the shape the next step
    # verifies (every stage lays its rows out by it); None for chains and static trees.
    draft_parents: np.ndarray | None = None

    def num_valid_drafts(self) -> list[int] | None:
        """Per row: its drafts up to the first PAD_TOKEN_ID (a drafter without a match, or a
        step that drafted fewer than K), the most the scheduler may have verified next step.
        The values stay here (apply_step_result stores them in the request states); the
        scheduler receives only these counts. None without speculation."""
        if self.drafts is None:
            return None
        pad = self.drafts < 0
        return np.where(pad.any(axis=1), pad.argmax(axis=1), pad.shape[1]).tolist()

    def sampled_token_lists(self) -> list[list[int]]:
        """The sampled tokens of each row as lists (what the scheduler consumes)."""
        return [row[:n] for row, n in zip(self.sampled.tolist(), self.num_sampled.tolist())]


def apply_step_result(states: RequestStates, result: StepResult, idx_mapping: np.ndarray) -> None:
    """Bring the request states up to date with one batch's result.

    idx_mapping [R]: the request-state slot of each row, -1 for rows to skip (a slot freed
    since, or a row that sampled nothing). For each kept row: roll num_computed back by the
    rejected drafts (it was advanced optimistically over every scheduled token), append the
    sampled tokens to the token history, store the new drafts."""
    rows = np.flatnonzero(idx_mapping >= 0)
    if len(rows) == 0:
        return
    slots = idx_mapping[rows]
    n = result.num_sampled[rows]
    states.num_computed[slots] -= result.num_rejected[rows]
    r, c = np.nonzero(np.arange(result.sampled.shape[1]) < n[:, None])
    states.token_ids[slots[r], states.num_tokens[slots[r]] + c] = result.sampled[rows[r], c]
    states.num_tokens[slots] += n
    if result.drafts is not None:
        states.draft_tokens[slots, : result.drafts.shape[1]] = result.drafts[rows]
