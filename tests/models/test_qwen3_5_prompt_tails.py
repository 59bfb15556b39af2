# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Hybrid Qwen3.5 prefix caching beyond vLLM: the end of a prompt that does not end on a block
boundary is cached (its partial KV block, and the linear-attention states there), so the next
turn of a chat whose turns are shorter than a block resumes at the previous prompt's end.

Block size 8. Turn 1 is a 45-token prompt answered with 2 tokens (its KV ends at 46, before the
boundary 48): without tails the next turn resumes at 40 (the prompt's last full block); with
them at 45, or 44 with MTP (a draft's KV at a position depends on the next token, so the tail
ends one token before the prompt's end and is keyed with that token). Every hit's output
equals a run without caching (greedy, logprobs included, and seeded); two requests extending
the same tail differently while its owner still decodes into that block each write into their
own copy (copy-on-write); a tail's block evicted from a small pool takes the tail with it.
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts

BS = 8
COMMON = dict(dtype="float32", max_model_len=128, block_size=BS, max_num_seqs=4)
MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
ANSWER = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def turn1() -> list[int]:
    return make_prompts(512, [45], seed=11)[0]


def _gen(llm: LLM, prompts, sp):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _same(a, b) -> None:
    """Equal tokens; equal logprobs where asked."""
    assert list(a.token_ids) == list(b.token_ids)
    for x, y in zip(a.logprobs or [], b.logprobs or []):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)


def _two_turns(llm: LLM, turn1: list[int], expected: int) -> None:
    """Turn 2 (greedy, then seeded) resumes at the tail with `expected` cached tokens and
    equals itself computed without any cache."""
    hot = {}
    for name, sp in (("greedy", GREEDY), ("seeded", SEEDED)):
        assert llm.reset_prefix_cache()
        answer = _gen(llm, [turn1], ANSWER)[0].outputs[0].token_ids
        turn2 = turn1 + list(answer) + make_prompts(512, [6], seed=12)[0]
        out = _gen(llm, [turn2], sp)[0]
        assert out.num_cached_tokens == expected
        hot[name] = (turn2, out.outputs[0])
    for name, sp in (("greedy", GREEDY), ("seeded", SEEDED)):
        assert llm.reset_prefix_cache()
        cold = _gen(llm, [hot[name][0]], sp)[0]
        assert cold.num_cached_tokens == 0
        _same(cold.outputs[0], hot[name][1])


@pytest.mark.parametrize("model", ["qwen3_5_dir", "qwen3_5_moe_dir"])
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_next_turn_resumes_at_the_prompt_end(request, turn1, model, mtp):
    path = request.getfixturevalue(model)
    kw = dict(speculative_config=MTP) if mtp else {}
    llm = LLM(model=path, **COMMON, **kw)
    try:
        _two_turns(llm, turn1, 44 if mtp else 45)
    finally:
        llm.shutdown()


def test_off_resumes_at_the_block_boundary(qwen3_5_dir, turn1):
    """mamba_cache_prompt_tail=False (--no-mamba-cache-prompt-tail): the block grid only."""
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--no-mamba-cache-prompt-tail"]
    )
    assert EngineArgs.from_cli_args(ns).mamba_cache_prompt_tail is False
    with pytest.raises(ValueError, match="mamba_cache_prompt_tail must be a bool"):
        LLM(model=qwen3_5_dir, mamba_cache_prompt_tail="no", **COMMON)
    llm = LLM(model=qwen3_5_dir, mamba_cache_prompt_tail=False, **COMMON)
    try:
        _two_turns(llm, turn1, 40)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_copy_on_write(qwen3_5_dir, turn1, mtp):
    """Turn 1 keeps decoding into its partial block (positions 45..50) while two requests
    extending its prompt differently start from the tail in one step: each computes after the
    tail in its own copy, and all three equal their runs without caching."""
    kw = dict(speculative_config=MTP) if mtp else {}
    llm = LLM(model=qwen3_5_dir, **COMMON, **kw)
    engine = llm.llm_engine
    ext = [turn1 + t for t in make_prompts(512, [3, 5], seed=13)]
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine.add_request("owner", {"prompt_token_ids": turn1}, sp)
        engine.step()  # the owner's prefill: the tail is usable from the next step
        for i, p in enumerate(ext):
            engine.add_request(f"ext{i}", {"prompt_token_ids": p}, sp)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        assert [done[f"ext{i}"].num_cached_tokens for i in range(2)] == [44 if mtp else 45] * 2
        assert llm.reset_prefix_cache()
        cold = _gen(llm, [turn1, *ext], sp)
        assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
        for rid, c in zip(["owner", "ext0", "ext1"], cold):
            _same(c.outputs[0], done[rid].outputs[0])
    finally:
        llm.shutdown()


def test_evicted_with_its_block(qwen3_5_dir, turn1):
    """12 KV blocks: turn 1 leaves 6 cached (5 full, its partial one freed first, so oldest);
    a 52-token prompt takes the 6 never used and one more, the partial block: the tail and
    its checkpoint go, and turn 2 resumes at the block boundary (40)."""
    llm = LLM(model=qwen3_5_dir, num_gpu_blocks_override=12, **{**COMMON, "max_model_len": 64})
    try:
        kvm = llm.llm_engine.scheduler.kv_cache_manager
        answer = _gen(llm, [turn1], ANSWER)[0].outputs[0].token_ids
        assert kvm.tails is not None and len(kvm.tails) == 1
        other = make_prompts(512, [52], seed=14)[0]
        assert _gen(llm, [other], ANSWER)[0].num_cached_tokens == 0
        assert len(kvm.tails) == 1  # the other prompt's own tail; turn 1's is gone
        turn2 = turn1 + list(answer) + make_prompts(512, [6], seed=12)[0]
        hot = _gen(llm, [turn2], GREEDY)[0]
        assert hot.num_cached_tokens == 40
        assert llm.reset_prefix_cache()
        cold = _gen(llm, [turn2], GREEDY)[0]
        assert cold.num_cached_tokens == 0
        _same(cold.outputs[0], hot.outputs[0])
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("pp_forkserver")
@pytest.mark.parametrize("model", ["qwen3_5_near_self_draft_dir", "qwen3_5_moe_dir"])
def test_pp2_mtp(request, turn1, model):
    """P = 2 with MTP: every stage copies the tail's block in its own layers' caches (the last
    stage's MTP layer too) and restores its own linear-attention layers' checkpoint."""
    path = request.getfixturevalue(model)
    llm = LLM(model=path, pipeline_parallel_size=2, speculative_config=MTP, **COMMON)
    try:
        _two_turns(llm, turn1, 44)
    finally:
        llm.shutdown()


def test_ray_pp2_mtp(qwen3_5_near_self_draft_dir, turn1):
    """Hybrid prefix caching under Ray (P = 2 stage actors, MTP): a hit on the block grid (a
    41-token prompt again resumes at 40; with MTP its tail would end at 40, on the boundary,
    so it has none) and the next turn at the prompt's tail (44), each equal to no caching."""
    ray = pytest.importorskip("ray")
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(
            model=qwen3_5_near_self_draft_dir,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            speculative_config=MTP,
            **COMMON,
        )
        try:
            assert type(llm.llm_engine.executor).__name__.startswith("Ray")
            p = make_prompts(512, [41], seed=15)[0]
            first, again = _gen(llm, [p], GREEDY)[0], _gen(llm, [p], GREEDY)[0]
            assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 40)
            _same(first.outputs[0], again.outputs[0])
            _two_turns(llm, turn1, 44)
        finally:
            llm.shutdown()
    finally:
        if own_ray:
            ray.shutdown()
