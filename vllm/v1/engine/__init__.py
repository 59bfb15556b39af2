# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The engine core's per-request step output (pure data, no torch: the scheduler builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.outputs import LogprobsLists


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsLists | None] | None = None
    prompt_logprobs: list[LogprobsLists | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # finish_reason "error": why the request could not run
