# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Scheduler test helpers: a minimal engine config, greedy requests, and a runner output that
samples one fixed token per request."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request


def sched_config(
    max_num_seqs: int = 8,
    budget: int = 32,
    max_model_len: int = 128,
    block_size: int = 4,
    k: int = 0,
    caching: bool = False,
    policy: str = "fcfs",
) -> SimpleNamespace:
    """The fields of a VllmConfig the Scheduler reads."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=True,
            max_model_len=max_model_len,
            policy=policy,
        ),
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=caching),
        num_speculative_tokens=k,
        speculative_config=SimpleNamespace(
            num_lookahead_tokens=1,
            num_speculative_tokens=k,
            adaptive_num_speculative_tokens=False,
            k_for_batch_size=lambda batch_size: k,
        )
        if k
        else None,
    )


def make_request(
    rid: str,
    tokens: Iterable[int],
    max_tokens: int = 4,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    sp.update_from_tokenizer(None)
    return Request(
        rid, list(tokens), sp, arrival_time, seed=0, cache_salt=cache_salt, priority=priority
    )


def answer(
    so: SchedulerOutput, token: int = 7, num_drafts: list[int] | None = None
) -> ModelRunnerOutput:
    ids = so.req_ids
    sampled = [[token] for _ in ids]
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, None, {}, num_drafts)
