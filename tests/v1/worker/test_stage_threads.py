# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""CPU pipeline stages choose their thread count per step: a step the engine runs alone (one
request: one stage computes while the other waits for it) uses every core the worker's
TP group may use, steps that overlap in the pipeline use the worker's share. The text is the
same as at P = 1 either way, with EAGLE3 drafting on the last stage."""

from __future__ import annotations

import os

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts
from vllm.testing.speculators_heads import make_speculators_eagle3

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.skipif((CORES or 1) < 2, reason="needs 2 cores to tell the two counts apart")
def test_stage_threads_follow_batches_in_flight(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the engine's own choice
    head = make_speculators_eagle3(tmp_path / "head", llama_dir, aux_layers=(1, 2, 3), seed=1)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    common = dict(dtype="float32", max_model_len=128, speculative_config=spec)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=llama_dir, pipeline_parallel_size=2, **common)
    try:
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": p} for p in make_prompts(vocab, [5, 9, 14, 7], seed=3)]
        executor = llm.llm_engine.executor
        alone = llm.generate(prompts[:1], sp, use_tqdm=False)
        stats = executor.comm_stats()
        for s in stats:  # both stages: every step alone, at every core
            assert s["threads_alone"] == CORES and s["threads_shared"] == CORES // 2, s
            assert s["steps_alone"] > 0 and s["steps_shared"] == 0, s
            assert s["threads_now"] == CORES, s
        together = llm.generate(prompts, sp, use_tqdm=False)
        for s in executor.comm_stats():  # two batches in flight: each stage its share
            assert s["steps_shared"] > 0, s
    finally:
        llm.shutdown()

    ref = LLM(model=llama_dir, **common)
    try:
        want = ref.generate(prompts, sp, use_tqdm=False)
    finally:
        ref.shutdown()
    assert [o.outputs[0].token_ids for o in alone] == [want[0].outputs[0].token_ids]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in want]
