# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Per-step statistics the engine aggregates into Prometheus metrics and log lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

JUMP_FORWARD = "jump_forward"
"""The proposer label of drafts that are a grammar's forced tokens (jump-forward)."""


def spec_proposer_names(spec: Any) -> list[str]:
    """The proposers whose drafts a speculative config can verify (the metrics' `proposer`
    label values): the method (the draft model's, or ngram / suffix / jump_forward), the
    hybrid's draft-free proposer, and jump-forward where the grammar may force drafts."""
    if spec is None:
        return []
    names = [spec.method]
    if spec.hybrid_method is not None:
        names.append(spec.hybrid_method)
    if spec.grammar_aware_drafting and JUMP_FORWARD not in names:
        names.append(JUMP_FORWARD)
    return names


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    per_proposer: dict[str, list[int]] = field(default_factory=dict)
    """proposer -> [drafts, draft tokens, accepted tokens]; sums to the totals above."""

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(
        self, num_draft_tokens: int, num_accepted_tokens: int, proposer: str = ""
    ) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        c = self.per_proposer.setdefault(proposer, [0, 0, 0])
        c[0] += 1
        c[1] += num_draft_tokens
        c[2] += num_accepted_tokens


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last take, in tokens (as vLLM counts them). Lookups of
    requests that were preempted are kept apart, so a request hitting its own blocks again on
    resumption does not inflate the hit rate."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None
    prefix_cache_stats: PrefixCacheStats | None = None


@dataclass
class FinishedRequestStats:
    """One finished sequence (each of an n > 1 request's completions counts, as in vLLM).
    Times in seconds: queued = arrival to first scheduled, prefill = first scheduled to first
    token, decode = first to last token, inference = prefill + decode, e2e = arrival to end."""

    finish_reason: str
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0


@dataclass
class IterationStats:
    """What one engine step observed for the per-request histograms."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    n_params_iter: list[int] = field(default_factory=list)
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)
