# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Pipeline parallelism end to end: P = 2 and P = 4 stage processes give the same greedy tokens
(and top logprobs) as P = 1 for Llama, Qwen2 and DeepSeek-V3, with chunked prefill and
preemption in the mix; the Ray backend gives the same tokens as mp; a killed stage makes the
engine raise and leaves no stage process behind; `vllm serve -pp 2` answers like P = 1.

Most engines here start their stages through a fork server (VLLM_WORKER_MULTIPROC_METHOD) so
torch is imported once for all of them; `vllm serve` uses the default, spawn."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest

from vllm import LLM, SamplingParams
from vllm.testing import checkpoints
from vllm.testing.engine_utils import make_prompts

LENGTHS = [3, 9, 17, 30, 41, 6]
MAX_TOKENS = 12
TOP = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
BATCH_TOKENS = 16  # forces chunked prefill of every prompt longer than this
KV_BLOCKS = 7  # fewer than the prompts need together: forces preemption
COMMON = dict(dtype="float32", max_model_len=128, enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def deepseek_v3_5l_dir(tmp_path_factory) -> str:
    """5-layer DeepSeek-V3 (dense layer 0, MoE after): 4 stages split it [1, 1, 2, 1]."""
    return checkpoints.make_deepseek_v3(tmp_path_factory.mktemp("dsv3_5l"), num_hidden_layers=5)


def _model_dir(request, model: str) -> str:
    return str(request.getfixturevalue(f"{model}_dir"))


def _gen(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


class _Reference:
    """P = 1 results and KV sizes per model, computed once per module."""

    def __init__(self) -> None:
        self.cache: dict[str, dict] = {}

    def get(self, model_dir: str) -> dict:
        if model_dir not in self.cache:
            llm = LLM(model=model_dir, **COMMON)
            try:
                engine = llm.llm_engine
                prompts = make_prompts(engine.model_config.vocab_size, LENGTHS, seed=3)
                runner = engine.executor.worker.model_runner
                per_layer_block = runner.kv_cache_bytes_per_block() // (
                    engine.model_config.num_hidden_layers
                )
                self.cache[model_dir] = {
                    "prompts": prompts,
                    "outputs": _gen(llm, prompts),
                    "per_layer_block": per_layer_block,
                }
            finally:
                llm.shutdown()
        return self.cache[model_dir]


@pytest.fixture(scope="module")
def reference() -> _Reference:
    return _Reference()


def _assert_same(outs, refs) -> None:
    for out, ref in zip(outs, refs, strict=True):
        got, want = out.outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids, (out.request_id, got.token_ids, want.token_ids)
        assert len(got.logprobs) == len(want.logprobs) == MAX_TOKENS
        for lp, lp_ref in zip(got.logprobs, want.logprobs):
            top = {t for t, v in lp.items() if v.rank <= TOP}
            top_ref = {t for t, v in lp_ref.items() if v.rank <= TOP}
            assert top == top_ref
            for t in top_ref:
                assert lp[t].logprob == pytest.approx(lp_ref[t].logprob, abs=1e-4)


def _max_stage_layers(num_layers: int, pp: int) -> int:
    from vllm.distributed.utils import get_pp_partition

    return max(get_pp_partition(num_layers, pp))


# model fixture, P, VLLM_PP_LAYER_PARTITION, expected layers per stage
CASES = [
    ("llama", 2, "3,1", [3, 1]),
    ("llama", 4, None, [1, 1, 1, 1]),
    ("qwen2", 2, None, [2, 2]),
    ("qwen2", 4, "1,1,1,1", [1, 1, 1, 1]),
    ("deepseek_v3", 2, None, [2, 1]),
    ("deepseek_v3_5l", 4, None, [1, 1, 2, 1]),
]


@pytest.fixture(scope="module")
def pp_runs(request, reference):
    """(model, P) -> (P > 1 outputs, the engine's preemption count); one engine per case."""
    cache: dict = {}

    def run(model: str, pp: int, partition: str | None):
        key = (model, pp)
        if key in cache:
            return cache[key]
        model_dir = _model_dir(request, model)
        ref = reference.get(model_dir)
        mp = pytest.MonkeyPatch()
        # One fork server imports torch once for all these engines' stages (the kill and serve
        # tests below use the default, spawn).
        mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
        if partition:
            mp.setenv("VLLM_PP_LAYER_PARTITION", partition)
        else:
            mp.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        try:
            from vllm.config import load_hf_config

            layers = int(load_hf_config(model_dir).num_hidden_layers)
            kv_bytes = KV_BLOCKS * ref["per_layer_block"] * _max_stage_layers(layers, pp)
            llm = LLM(
                model=model_dir,
                pipeline_parallel_size=pp,
                max_num_batched_tokens=BATCH_TOKENS,
                kv_cache_memory_bytes=kv_bytes,
                # The pool's tokens (start-up refuses a longer max_model_len).
                **{**COMMON, "max_model_len": KV_BLOCKS * 16},
            )
        finally:
            mp.undo()
        try:
            engine = llm.llm_engine
            assert engine.vllm_config.cache_config.num_gpu_blocks == KV_BLOCKS
            outs = _gen(llm, ref["prompts"])
            cache[key] = (outs, engine.scheduler.num_preemptions)
        finally:
            llm.shutdown()
        return cache[key]

    return run


@pytest.mark.parametrize("model, pp, partition, parts", CASES)
def test_pp_equals_p1(request, reference, pp_runs, model, pp, partition, parts):
    from vllm.config import load_hf_config

    model_dir = _model_dir(request, model)
    layers = int(load_hf_config(model_dir).num_hidden_layers)
    if partition is None:
        from vllm.distributed.utils import get_pp_partition

        assert get_pp_partition(layers, pp) == parts
    outs, preemptions = pp_runs(model, pp, partition)
    assert preemptions > 0, "the KV budget was meant to force preemption"
    _assert_same(outs, reference.get(model_dir)["outputs"])


def test_batch_queue_in_process(llama_dir, reference, monkeypatch):
    """The engine's pipelined step (P batches in flight, requests spread over them) on the
    in-process executor: same outputs, and batches really overlap."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    ref = reference.get(llama_dir)
    monkeypatch.setattr(UniProcExecutor, "max_concurrent_batches", 2, raising=False)
    llm = LLM(model=llama_dir, max_num_batched_tokens=BATCH_TOKENS, **COMMON)
    try:
        executor = llm.llm_engine.executor
        queue = llm.llm_engine._batch_queue
        seen: list[tuple[int, int]] = []  # (batches in flight, requests in the new batch)
        submit = executor.execute_model_async

        def spy(so):
            seen.append((len(queue) + 1, len(so.num_scheduled_tokens)))
            submit(so)

        monkeypatch.setattr(executor, "execute_model_async", spy)
        _assert_same(_gen(llm, ref["prompts"]), ref["outputs"])
    finally:
        llm.shutdown()
    assert max(n for n, _ in seen) == 2
    assert max(r for _, r in seen) <= -(-len(LENGTHS) // 2)  # each batch takes its share


# ---- Ray -------------------------------------------------------------------------------------
def test_ray_equals_mp(llama_dir, pp_runs):
    import ray

    mp_outs, _ = pp_runs("llama", 2, "3,1")
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        os.environ["VLLM_PP_LAYER_PARTITION"] = "3,1"
        try:
            llm = LLM(
                model=llama_dir,
                pipeline_parallel_size=2,
                distributed_executor_backend="ray",
                max_num_batched_tokens=BATCH_TOKENS,
                **COMMON,
            )
        finally:
            del os.environ["VLLM_PP_LAYER_PARTITION"]
        try:
            pids = llm.llm_engine.executor.worker_pids
            assert len(pids) == 2 and os.getpid() not in pids
            prompts = [o.prompt_token_ids for o in mp_outs]
            outs = _gen(llm, prompts)
            assert [o.outputs[0].token_ids for o in outs] == [
                o.outputs[0].token_ids for o in mp_outs
            ]
        finally:
            llm.shutdown()
        procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"Ray stage actors still running: {alive}"
    finally:
        if own_ray:
            ray.shutdown()


# ---- failure ---------------------------------------------------------------------------------
def test_stage_error_raises_and_stops_every_stage(llama_dir, monkeypatch):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    llm = LLM(model=llama_dir, pipeline_parallel_size=2, **COMMON)
    executor = llm.llm_engine.executor
    procs = [psutil.Process(p) for p in executor.worker_pids]
    try:
        ghost = SchedulerOutput(
            [], CachedRequestData(["ghost"], [[]], [0]), {"ghost": 1}, 1, {}, set()
        )
        with pytest.raises(RuntimeError, match="pipeline stage [01] failed: KeyError: 'ghost'"):
            executor.execute_model(ghost)
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"stage processes left behind: {alive}"
    finally:
        llm.shutdown()


def test_killed_stage_raises_and_leaves_no_process(llama_dir, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    llm = LLM(model=llama_dir, pipeline_parallel_size=2, **COMMON)
    engine = llm.llm_engine
    executor = engine.executor
    procs = [psutil.Process(p) for p in executor.worker_pids]
    try:
        prompts = make_prompts(engine.model_config.vocab_size, [5, 7, 9], seed=1)
        sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        outcome: dict = {}

        def drive() -> None:
            produced = 0
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        produced += len(out.outputs[0].token_ids)
                    if produced >= 6 and "killed" not in outcome:
                        os.kill(procs[0].pid, signal.SIGKILL)  # mid-generation
                        outcome["killed"] = True
                outcome["finished"] = True
            except BaseException as e:  # noqa: BLE001 - inspected below
                outcome["error"] = e

        t = threading.Thread(target=drive, daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "the engine hung after a stage was killed"
        assert outcome.get("killed"), outcome
        err = outcome.get("error")
        assert isinstance(err, RuntimeError), outcome
        assert "pipeline stage 0" in str(err) and "died" in str(err)
        _, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"stage processes left behind: {alive}"
        with pytest.raises(RuntimeError, match="stopped after an error"):
            engine.step() if engine.has_unfinished_requests() else executor.get_output()
    finally:
        llm.shutdown()
        for p in procs:
            if p.is_running():
                p.kill()


# ---- server ----------------------------------------------------------------------------------
def test_serve_pp2_equals_p1(llama_dir, reference, tmp_path):
    import openai

    from vllm.testing.remote_server import RemoteServer

    with RemoteServer(
        llama_dir,
        ["-pp", "2", "--dtype", "float32", "--max-model-len", "128"],
        tmp_path / "serve.log",
    ) as server:
        server.wait_ready()
        stages = server.children()
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
        ref = reference.get(llama_dir)["outputs"][:3]
        for r in ref:
            res = client.completions.create(
                model=llama_dir,
                prompt=r.prompt_token_ids,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=TOP,
                extra_body={"ignore_eos": True},
            )
            choice = res.choices[0]
            assert choice.text == r.outputs[0].text
            want = [lp[t].logprob for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        assert server.stop(timeout=60) == 0, server.log_tail()
        _, alive = psutil.wait_procs(stages, timeout=30)
        assert not alive, f"processes left behind by the server: {alive}"
