# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Prefix caching for hybrid Qwen3.5 (linear-attention states checkpointed on the block grid):
a request sharing a cached prefix resumes at the last checkpointed block boundary, computes
only the rest, and its output equals HF transformers' and a cold run's - at P = 1 (dense, MoE,
chunked prefill, MTP with rejections, a multi-turn continuation past decoded boundaries), at
P = 2 and TP = 2; checkpoints are evicted with their KV blocks and LRU; a corrupted checkpoint
changes the output (the restore is what the hit runs on).

The prompt set: A, B, C share a 90-token base (block size 8: 11 full blocks) and differ after
it. A (97 tokens) is checkpointed at its last full block (96). B finds the base's KV blocks but
no checkpoint inside them, so it computes everything and checkpoints where the cached run ended
(88, the shared prefix's end); C resumes there; A again resumes at 96.
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import hf_greedy, make_prompts

BS = 8
COMMON = dict(dtype="float32", max_model_len=256, block_size=BS, max_num_seqs=4)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
EXPECTED_CACHED = [0, 0, 88, 96]
MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive_num_speculative_tokens": False}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    base = make_prompts(512, [90], seed=1)[0]
    tails = make_prompts(512, [7, 5, 6], seed=2)
    return [base + tails[0], base + tails[1], base + tails[2], base + tails[0]]


_HF: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _hf(path: str, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    key = (path, tuple(prompt))
    if key not in _HF:
        _HF[key] = hf_greedy(path, prompt, n)
    return _HF[key][:n]


def _one_by_one(llm: LLM, prompts, sp=GREEDY):
    return [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]


def _hits(llm: LLM) -> int:
    return next(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def _check(llm: LLM, path: str, prompts, expected_cached=EXPECTED_CACHED) -> list:
    outs = _one_by_one(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == expected_cached
    assert _hits(llm) == sum(expected_cached)
    for o, p in zip(outs, prompts):
        assert list(o.outputs[0].token_ids) == _hf(path, p)
    # The hit run of A equals its cold run, logprobs included.
    cold, hit = outs[0].outputs[0], outs[3].outputs[0]
    for a, b in zip(cold.logprobs, hit.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    return outs


@pytest.mark.parametrize("model", ["qwen3_5_dir", "qwen3_5_moe_dir"])
def test_hits_equal_hf_and_cold_run(request, prompts, model):
    path = request.getfixturevalue(model)
    llm = LLM(model=path, **COMMON)
    try:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
        _check(llm, path, prompts)
        # Seeded sampling: the hit run draws what the cold run drew.
        sp = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
        cold, hit = _one_by_one(llm, [prompts[1], prompts[1]], sp)
        assert hit.num_cached_tokens == 88 and cold.num_cached_tokens == 88
        llm.reset_prefix_cache()
        fresh = _one_by_one(llm, [prompts[1]], sp)[0]
        assert fresh.num_cached_tokens == 0
        assert fresh.outputs[0].token_ids == cold.outputs[0].token_ids == hit.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_restored_state_is_what_the_hit_runs_on(qwen3_5_dir, prompts):
    """The hit computes only the tokens after the checkpoint, from the checkpoint: scribbling
    over every saved checkpoint makes the hit's output wrong (so a hit that recomputed or read
    some other state would be caught by the comparisons above)."""
    llm = LLM(model=qwen3_5_dir, **COMMON)
    scheduled: list[dict[str, int]] = []
    sched = llm.llm_engine.scheduler
    orig = sched.schedule

    def spy(*a, **kw):
        so = orig(*a, **kw)
        scheduled.append(dict(so.num_scheduled_tokens))
        return so

    sched.schedule = spy
    try:
        a = prompts[0]
        first = _one_by_one(llm, [a])[0]
        assert first.num_cached_tokens == 0
        assert [d for d in scheduled if d][0] == {first.request_id: len(a)}
        scheduled.clear()
        runner = llm.llm_engine.executor.worker.model_runner
        for tensors in runner.linear_attn_states.checkpoints.values():
            for t in tensors:
                t.normal_()
        again = _one_by_one(llm, [a])[0]
        assert again.num_cached_tokens == 96
        assert [d for d in scheduled if d][0] == {again.request_id: len(a) - 96}
        assert list(first.outputs[0].token_ids) == _hf(qwen3_5_dir, a)
        assert list(again.outputs[0].token_ids) != _hf(qwen3_5_dir, a)
    finally:
        llm.shutdown()


def test_chunked_prefill_checkpoints_every_chunk(qwen3_5_dir, prompts):
    """A 16-token budget: each chunk checkpoints its last boundary, so B already resumes at
    80 (the last chunk end inside the shared base)."""
    llm = LLM(model=qwen3_5_dir, max_num_batched_tokens=16, **COMMON)
    try:
        _check(llm, qwen3_5_dir, prompts, [0, 80, 88, 96])
    finally:
        llm.shutdown()


def test_mtp_hits_and_multi_turn(qwen3_5_near_self_draft_dir, prompts):
    """MTP (K = 2, drafts partly rejected): hits as without speculation, and a follow-up turn
    (A + A's answer + more) resumes at a boundary inside A's answer, checkpointed during its
    verify steps from known tokens only (a rejected draft never reaches a checkpoint)."""
    path = qwen3_5_near_self_draft_dir
    llm = LLM(model=path, speculative_config=MTP, **COMMON)
    try:
        outs = _check(llm, path, prompts)
        m = {x.name: x for x in llm.get_metrics()}
        drafts = m["vllm:spec_decode_num_draft_tokens"].value
        accepted = m["vllm:spec_decode_num_accepted_tokens"].value
        assert 0 < accepted < drafts
        turn = prompts[0] + list(outs[0].outputs[0].token_ids) + make_prompts(512, [5], 3)[0]
        out = _one_by_one(llm, [turn])[0]
        assert out.num_cached_tokens == 104  # 97 prompt + 10 answer: boundary 104
        assert list(out.outputs[0].token_ids) == _hf(path, turn)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("pp_forkserver")
@pytest.mark.parametrize(
    "kw",
    [dict(pipeline_parallel_size=2, speculative_config=MTP), dict(tensor_parallel_size=2)],
    ids=["pp2_mtp", "tp2"],
)
def test_hits_across_stages_and_ranks(qwen3_5_near_self_draft_dir, prompts, kw):
    """Each stage (each TP rank) checkpoints and restores its own layers' states."""
    llm = LLM(model=qwen3_5_near_self_draft_dir, **COMMON, **kw)
    try:
        _check(llm, qwen3_5_near_self_draft_dir, prompts)
    finally:
        llm.shutdown()


def test_eviction_with_kv_blocks_and_lru(qwen3_5_dir, prompts):
    """16 KV blocks (A and D take 13 each with their answers): D evicts A's blocks, A's
    checkpoint goes with them; then one checkpoint only: D's replaces A's (LRU)."""
    a, d = prompts[0], make_prompts(512, [97], seed=5)[0]
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for kw in (dict(num_gpu_blocks_override=16), dict(mamba_num_checkpoints=1)):
        llm = LLM(model=qwen3_5_dir, **{**COMMON, "max_model_len": 128}, **kw)
        try:
            outs = _one_by_one(llm, [a, d, d, a], short)
            assert [o.num_cached_tokens for o in outs] == [0, 0, 96, 0]
            for o, p in zip(outs, [a, d, d, a]):
                assert list(o.outputs[0].token_ids) == _hf(qwen3_5_dir, p, 4)
            kvm = llm.llm_engine.scheduler.kv_cache_manager
            assert kvm.checkpoints.num_registered <= kvm.checkpoints.num_checkpoints
        finally:
            llm.shutdown()


def test_config_and_sizing(qwen3_5_dir, caplog):
    """On by default for hybrids; mamba_cache_mode='none' turns it off (True with 'none' is an
    error); the checkpoints are part of the start-up memory sizing."""
    with pytest.raises(ValueError, match="mamba_cache_mode is 'none'"):
        LLM(model=qwen3_5_dir, enable_prefix_caching=True, mamba_cache_mode="none", **COMMON)
    with pytest.raises(ValueError, match="mamba_num_checkpoints"):
        LLM(model=qwen3_5_dir, kv_cache_memory_bytes=300_000, mamba_num_checkpoints=64, **COMMON)
    llm = LLM(model=qwen3_5_dir, mamba_cache_mode="none", **COMMON)
    try:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
        p = make_prompts(512, [30], seed=6)[0]
        assert [o.num_cached_tokens for o in _one_by_one(llm, [p, p])] == [0, 0]
    finally:
        llm.shutdown()
    llm = LLM(model=qwen3_5_dir, mamba_num_checkpoints=5, **COMMON)
    try:
        las = llm.llm_engine.executor.worker.model_runner.linear_attn_states
        per = las.bytes_per_slot()
        assert las.bytes() == per * (4 * 1 + 5)
        assert all(t.shape[0] == 5 for ts in las.checkpoints.values() for t in ts)
    finally:
        llm.shutdown()


def test_boundary_passed_on_accepted_drafts(qwen3_5_self_draft_dir, prompts):
    """K = 3, every draft accepted: decoding A's answer jumps 97 -> 101 -> 105, past boundary
    104 on drafts not known when that step was scheduled; the next step checkpoints it from
    the per-token states the verify step kept, and a follow-up turn resumes there."""
    path = qwen3_5_self_draft_dir
    spec = {**MTP, "num_speculative_tokens": 3}
    llm = LLM(model=path, speculative_config=spec, **COMMON)
    saves: list[tuple[int, int, int]] = []  # (boundary, tokens computed before the step, id)
    sched = llm.llm_engine.scheduler
    orig = sched.schedule

    def spy(*a, **kw):
        so = orig(*a, **kw)
        for d in so.scheduled_new_reqs:
            saves.extend(
                (p, d.num_computed_tokens, ck)
                for p, ck in so.state_checkpoint_saves.get(d.req_id, [])
            )
        cr = so.scheduled_cached_reqs
        for rid, c in zip(cr.req_ids, cr.num_computed_tokens):
            saves.extend((p, c, ck) for p, ck in so.state_checkpoint_saves.get(rid, []))
        return so

    sched.schedule = spy
    try:
        a = prompts[0]
        first = _one_by_one(llm, [a])[0]
        assert list(first.outputs[0].token_ids) == _hf(path, a)
        assert (104, 105) in [(p, c) for p, c, _ in saves]  # copied after the fact
        turn = a + list(first.outputs[0].token_ids) + make_prompts(512, [5], 3)[0]
        out = _one_by_one(llm, [turn])[0]
        assert out.num_cached_tokens == 104
        assert list(out.outputs[0].token_ids) == _hf(path, turn)
    finally:
        llm.shutdown()
