# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Start-up: the log states its time by phase, the warm-up runs one small step of each kind
(a fresh prefill chunk, a chunk over a cached context, decode rows) instead of a full token
budget, and the adaptive-K cost measurement stops at its time budget."""

from __future__ import annotations

import logging

import pytest

from vllm import LLM, SamplingParams
from vllm.config.scheduler import WARMUP_TOKENS
from vllm.v1.engine.llm_engine import num_state_slots
from vllm.v1.engine.warmup import warm_up


@pytest.fixture
def vllm_logs(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    caplog.set_level(logging.INFO, logger="vllm")
    return caplog


def test_startup_phases_are_logged_and_the_warm_up_is_small(llama_dir, vllm_logs):
    llm = LLM(model=llama_dir, max_num_seqs=8, max_model_len=256)
    try:
        engine = llm.llm_engine
        phases = engine.startup_phases
        assert list(phases) == ["tokenizer", "load", "pools", "warm-up", "engine"]
        assert all(v >= 0 for v in phases.values())
        line = next(r.getMessage() for r in vllm_logs.records if "Start-up:" in r.getMessage())
        for name in phases:
            assert f"{name} " in line, line
        warm = next(r.getMessage() for r in vllm_logs.records if "Warm-up:" in r.getMessage())
        assert "2 steps" in warm, warm

        # The warm-up again, recording what it schedules: the shape classes, two steps.
        seen = []
        real = engine.executor.execute_model

        def record(so):
            seen.append(so)
            return real(so)

        engine.executor.execute_model = record  # type: ignore[method-assign]
        try:
            cfg = engine.vllm_config
            blocks = cfg.cache_config.num_gpu_blocks
            reqs, prompt_tokens, steps = warm_up(cfg, engine.executor, blocks, num_state_slots(cfg))
        finally:
            del engine.executor.execute_model
        assert steps == 2 and reqs == 4
        assert prompt_tokens <= 2 * WARMUP_TOKENS
        assert all(so.total_num_scheduled_tokens <= WARMUP_TOKENS for so in seen)
        first, second = seen[0], seen[1]
        fresh = [d for d in first.scheduled_new_reqs if first.num_scheduled_tokens[d.req_id] > 2]
        assert len(fresh) == 1 and fresh[0].num_computed_tokens == 0  # a fresh prefill chunk
        cached = second.scheduled_cached_reqs
        q = [second.num_scheduled_tokens[r] for r in cached.req_ids]
        chunk = [n for n, c in zip(q, cached.num_computed_tokens) if n > 1 and c > 0]
        assert len(chunk) == 1  # a chunk attending to its cached context
        assert q.count(1) == 3  # decode rows next to it

        # Serving is unaffected by the warm-ups.
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_step_cost_measurement_stops_at_its_budget(llama_dir, monkeypatch, vllm_logs):
    """A budget too small for anything: only the first two batch sizes are timed (the cost
    model extrapolates past them), and the phase is logged."""
    monkeypatch.setenv("VLLM_STEP_COST_BUDGET_S", "1e-9")
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = LLM(model=llama_dir, max_num_seqs=8, max_model_len=256, speculative_config=spec)
    try:
        engine = llm.llm_engine
        assert "step costs" in engine.startup_phases
        spec_k = engine.scheduler.spec_k
        assert spec_k is not None and spec_k.costs is not None
        assert spec_k.costs.batch_sizes == [1, 2]
    finally:
        llm.shutdown()
