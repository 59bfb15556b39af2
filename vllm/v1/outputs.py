# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What the model runner hands back to the engine each step (pure data, picklable, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogprobsLists:
    """Top logprobs of one sampled token: ids[0] is the sampled token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[LogprobsLists | None]] | None = None
    prompt_logprobs: dict[str, list[LogprobsLists | None]] = field(default_factory=dict)
    num_draft_tokens: list[int] | None = None
    """Per request: how many drafts it proposed for the next step (up to its first padding
    entry); the worker keeps their values. None: no speculation."""
    draft_confidences: list[list[float]] | None = None
    """adaptive_draft_confidence: per request, the running product of the draft's
    probabilities of its drafts (one per draft); None: not reported."""
    draft_proposers: list[str] | None = None
    """Per request: which proposer drafted them (hybrid, jump-forward)."""
    accepted_tree_nodes: list[list[int]] | None = None
    """Draft trees: per request, the node indices of the accepted path this step verified
    (increasing; empty without drafts). None without a tree."""
