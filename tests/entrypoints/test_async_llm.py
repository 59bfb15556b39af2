# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""AsyncLLM in-process: concurrent generate, cancellation aborts, errors stay with their
request, an engine crash fails everything and marks the engine dead."""

from __future__ import annotations

import asyncio
import threading

import pytest

from vllm import EngineArgs, SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.v1.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def model_dir(llama_dir) -> str:
    return str(llama_dir)


@pytest.fixture
def async_llm(model_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, dtype="float32", max_model_len=128))
    yield llm
    llm.shutdown()


def _greedy(n: int, kind=RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind)


def test_generate_concurrent_delta_equals_final(async_llm):
    prompts = ["import os", "def f(x):", "class A:"]

    async def collect(i: int, kind) -> tuple[str, list[int]]:
        text, toks = "", []
        async for out in async_llm.generate(prompts[i], _greedy(6, kind), f"{kind.name}-{i}"):
            if kind == RequestOutputKind.DELTA:
                text += out.outputs[0].text
                toks += out.outputs[0].token_ids
            else:
                text, toks = out.outputs[0].text, out.outputs[0].token_ids
        assert out.finished
        return text, toks

    async def main():
        return await asyncio.gather(
            *(
                collect(i, k)
                for k in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)
                for i in range(3)
            )
        )

    res = asyncio.run(main())
    assert res[:3] == res[3:]
    assert all(len(toks) == 6 for _, toks in res)


def test_cancel_aborts_and_bad_prompt_fails_alone(async_llm):
    engine = async_llm.engine

    async def main():
        gen = async_llm.generate("while True:", _greedy(100), "long")
        first = await gen.__anext__()
        assert not first.finished
        ok = asyncio.ensure_future(_drain(async_llm.generate("x = 1", _greedy(4), "ok")))
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            await _drain(async_llm.generate(list(range(5, 300)), _greedy(4), "too-long"))
        task = asyncio.ensure_future(_drain(gen))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await ok

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"

    async def wait_idle():
        for _ in range(200):
            if not engine.has_unfinished_requests() and "long" not in async_llm._streams:
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(wait_idle())
    assert engine.scheduler.kv_cache_manager.usage() == 0.0
    assert async_llm.is_running and not async_llm.errored


async def _drain(agen):
    return [o async for o in agen]


def test_engine_crash_fails_all_and_marks_dead(model_dir):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model_dir, dtype="float32", max_model_len=128)
    )
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    engine.step = flaky_step
    died = []
    llm = AsyncLLM(engine, on_dead=died.append)
    try:

        async def main():
            return await asyncio.gather(
                *(_drain(llm.generate("abc", _greedy(50), f"r{i}")) for i in range(3)),
                return_exceptions=True,
            )

        res = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in res), res
        llm._thread.join(30)  # it still shuts the executor down after failing the requests
        assert llm.errored and not llm.is_running and len(died) == 1
        with pytest.raises(EngineDeadError):
            asyncio.run(_drain(llm.generate("abc", _greedy(2), "late")))
        assert engine.executor is None  # the executor was shut down
    finally:
        llm.shutdown()


def test_tokenising_does_not_hold_up_running_streams(async_llm, monkeypatch):
    """While one request's prompt is being tokenised (held here until released), a running
    stream produces every one of its tokens: tokenising happens on the tokenizer thread, not
    on the engine thread or the event loop."""
    engine = async_llm.engine
    real = engine.process_prompt_mm  # what add_request tokenises with (images too)
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []

    def held(prompt):
        threads.append(threading.current_thread().name)
        if prompt == "held back":
            entered.set()
            if not release.wait(120):
                raise TimeoutError("never released")
        return real(prompt)

    monkeypatch.setattr(engine, "process_prompt_mm", held)

    async def main():
        loop = asyncio.get_running_loop()
        running = async_llm.generate("def f(x):", _greedy(12), "running")
        first = await running.__anext__()
        held_back = asyncio.ensure_future(_drain(async_llm.generate("held back", _greedy(3), "h")))
        assert await loop.run_in_executor(None, entered.wait, 60)
        rest = await asyncio.wait_for(_drain(running), 120)
        assert not held_back.done()
        release.set()
        return [first, *rest], await asyncio.wait_for(held_back, 120)

    try:
        outs, held_outs = asyncio.run(main())
    finally:
        release.set()
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 12 and outs[-1].finished
    assert held_outs[-1].finished
    assert threads and all(name.startswith("vllm-tokenizer") for name in threads), threads
