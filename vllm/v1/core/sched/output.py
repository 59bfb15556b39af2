# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What the scheduler decides each step (pure data, picklable, the same for every stage)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalInputs
from vllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the batch (first time, or again after preemption)."""

    req_id: str
    prefill_token_ids: list[int]  # prompt, plus outputs so far when resumed after preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    state_slot: int = -1
    """Hybrid models: the KV cache manager's state slot for the linear-attention states."""
    state_checkpoint: int = -1
    """Hybrid models starting after a prefix-cache hit: the checkpoint of the linear-attention
    states (after num_computed_tokens tokens) it resumes from; -1: none."""
    mm_inputs: MultiModalInputs | None = None
    """Multimodal prompts: the images (the first stage encodes them) and M-RoPE positions."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (enable_lora); None: the base model."""


@dataclass
class CachedRequestData:
    """Requests already in the batch: new blocks and the scheduler's computed count."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # batch order = insertion order
    total_num_scheduled_tokens: int
    num_draft_tokens: dict[str, int]
    """Requests verifying drafts this step: how many of the drafts the worker proposed for it
    last step (their first ones; the worker keeps the values, the scheduler only counts)."""
    finished_req_ids: set[str]  # finished or preempted since the last step: free their slots
    step_id: int = 0
    num_prompt_tokens: int = 0  # prompt (or recomputed) tokens among the scheduled ones
    num_draft_steps: int | None = None
    """The most drafts any request of this step verifies next step (its proposer may skip the
    draft steps after them); None: num_speculative_tokens."""
    req_draft_steps: dict[str, int] | None = None
    """The drafts each request of this step verifies next step (a draft model drafts only
    those rows that deep; a one-layer EAGLE draft puts its first pass off while every count
    is 0); None: num_draft_steps for every request (a count forced on all, never deferring)."""
    draft_confidence_floor: tuple[float, float] | None = None
    """adaptive_draft_confidence: (the confidence a request's next draft must promise, the sum
    a draft pass must promise) - DraftConfidence.floor in core/sched/draft_confidence.py."""
    state_checkpoint_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Hybrid models with prefix caching: per request, (tokens, checkpoint id) of the
    linear-attention states this step saves, the state after that many of its tokens."""
    batches_in_flight: int = 1
    """Steps the engine had started and not finished when it started this one, this one
    included (pipeline parallelism). 1: the stages run it alone - at batch 1 one stage works
    while the others wait - so a CPU stage may take every core (Worker.execute_model)."""
    kv_block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks every stage copies, in every attention layer's cache,
    before this step's forward: a request resuming from a cached prompt tail gets its own copy
    of the tail's partial block (copy-on-write)."""

    def without_pixel_values(self) -> SchedulerOutput:
        """What a pipeline stage after the first receives: the same step, its new requests'
        images without pixel values (only the first stage runs the encoder; later stages need
        the placeholder runs and M-RoPE positions alone). Self when no image has any."""
        if not any(
            d.mm_inputs is not None and d.mm_inputs.pixel_bytes for d in self.scheduled_new_reqs
        ):
            return self
        new = [
            d
            if d.mm_inputs is None
            else dataclasses.replace(d, mm_inputs=d.mm_inputs.without_pixel_values())
            for d in self.scheduled_new_reqs
        ]
        return dataclasses.replace(self, scheduled_new_reqs=new)

    @property
    def req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)

    @classmethod
    def empty(cls, finished: set[str], step_id: int = 0) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, {}, finished, step_id)
