# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Two pipeline stages with MTP: after many steps no stage holds more posted sends than batches
in flight (gloo's sends never report completion on their own, so the old bookkeeping kept every
step's tensors), and a stage that stops answering while the engine is idle is detected by the
liveness ping within VLLM_PP_STEP_TIMEOUT_S, every stage then being stopped."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts, resume_and_kill
from vllm.v1.worker.gpu.pp_utils import SENDS_PER_BATCH

P = 2


def test_pending_sends_bounded_and_idle_hang_detected(deepseek_v3_mtp1_dir, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    monkeypatch.setenv("VLLM_PP_STEP_TIMEOUT_S", "3")
    llm = LLM(
        model=str(deepseek_v3_mtp1_dir),
        pipeline_parallel_size=P,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,  # chunked prefill: many steps
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 2,
        },
    )
    executor = llm.llm_engine.executor
    procs = [psutil.Process(p) for p in executor.worker_pids]
    try:
        prompts = make_prompts(llm.llm_engine.model_config.vocab_size, [3, 9, 17, 30, 41, 6], 2)
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        steps = executor.comm_stats()[1]["steps"]  # batches stage 1 received from stage 0
        assert steps >= 40, steps  # the old bookkeeping would hold this many sends
        first, last = executor.collective_rpc("pending_sends")
        assert first["p2p"] <= P, first
        assert last["broadcast"] <= SENDS_PER_BATCH * P, last

        # Idle, one stage stops: the next liveness ping gets no answer and fails the engine.
        os.kill(procs[1].pid, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match=rf"stage 1 \(pid {procs[1].pid}\) is stopped"):
            executor.check_health()
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"stage processes left behind: {alive}"
    finally:
        resume_and_kill(procs)
        llm.shutdown()
