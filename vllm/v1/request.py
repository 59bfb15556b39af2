# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Request and its status, as the scheduler tracks it (pure Python)."""

from __future__ import annotations

import enum
import time

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalInputs
from vllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(status)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        mm_inputs: MultiModalInputs | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        # Images (placeholder runs, pixels, content hashes) and M-RoPE positions, if any.
        self.mm_inputs = mm_inputs
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority  # lower runs first under the 'priority' scheduling policy
        # Seed of the sampling noise: the request's own, or one drawn by the engine.
        self.seed = seed if seed is not None else sampling_params.seed
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Drafts the worker holds for it that the next step may verify (their values stay on
        # the worker), and who proposed them ("": the configured method).
        self.num_drafts = 0
        self.spec_proposer = ""
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.in_flight = 0  # scheduled steps whose output has not come back (pipelining)
        # Prefix caching: salt mixed into the first block's hash (only requests with the same
        # salt share blocks), the hashes of the full blocks so far, and the prompt tokens found
        # cached when the request was first scheduled (-1: not scheduled yet).
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + self.num_drafts

    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, so nothing is skipped.
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
