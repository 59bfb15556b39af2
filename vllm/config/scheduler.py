# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SchedulerConfig: batching limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulerPolicy = Literal["fcfs", "priority"]

# Token budget of one start-up warm-up step (vllm/v1/engine/warmup.py): enough for a prefill
# chunk that takes the prefill paths, small enough to cost little. A CPU worker keeps
# activations up to the size of such a step's on its heap (ModelRunner.initialize_kv_cache).
WARMUP_TOKENS = 64


@dataclass
class SchedulerConfig:
    """Batching limits."""

    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps."""
    max_model_len: int = 2048
    """Copied from ModelConfig."""
    policy: SchedulerPolicy = "fcfs"
    """Order of waiting requests: 'fcfs' (arrival) or 'priority' (a request's priority,
    lower first, then arrival; preemption takes the lowest-priority running request)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
