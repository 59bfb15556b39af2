# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Automatic prefix caching end to end: with caching on, greedy tokens and logprobs equal
caching off for Llama, DeepSeek-V3 (MLA), V3.2 (DSA) and with MTP / EAGLE3 speculation
(identical drafts and acceptance), at P = 1 and P = 2, for shared prefixes of several lengths
(block-aligned and not), under preemption and eviction, and while another request still runs on
the shared blocks; hits are where a brute-force prefix match says; prompt_logprobs bypass the
cache; cache_salt isolates. Hybrid Qwen3.5: tests/e2e/test_hybrid_prefix_caching.py."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest
from prometheus_client import generate_latest

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.testing.dsa_checkpoints import make_deepseek_v32
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import make_eagle3_draft, make_mtp_self_draft

BS = 4  # small blocks: many block boundaries in short prompts
MAX_TOKENS = 8
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=BS)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


pytestmark = pytest.mark.usefixtures("pp_forkserver")


def _prompt_set(vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes of 8 and 16 (block-aligned), 11 and 23 (not) and 30 tokens of
    one base; two of them share block 3 but differ at the first token after it (a draft's KV
    at the block's last position differs there); one is a block-aligned prefix of the base."""
    base = make_prompts(vocab, [30], seed=11)[0]
    tails = make_prompts(vocab, [5, 7, 3, 6], seed=12)
    other = 1 + (base[16] % (vocab - 1))  # != base[16]
    return [
        base[:8] + tails[0],
        base[:11] + tails[1],
        base[:16] + [other] + tails[2],
        base[:23] + tails[0][:2],
        base,
        base[:12],
        make_prompts(vocab, [9], seed=13)[0],
    ]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expected_first_round_hits(prompts: list[list[int]], extra: int) -> list[int]:
    """Brute force: prompts admitted together, in order, each computing its whole prompt.
    Prompt j reuses block k of an earlier prompt i when both agree on tokens 0..(k+1)B-1 (and,
    with a draft, on the token after the block, which i must know), leaving its last token."""
    out = []
    for j, p in enumerate(prompts):
        best = 0
        for q in prompts[:j]:
            lcp = _lcp(p, q)
            k = 0
            while (k + 1) * BS <= len(p) - 1 and (k + 1) * BS + extra <= min(lcp, len(q)):
                k += 1
            best = max(best, k)
        out.append(best * BS)
    return out


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    cached: list[int]
    metrics: dict[str, object]
    drafts: dict[str, list[list[int]]] = field(default_factory=dict)
    num_preemptions: int = 0


def _draft_log(llm: LLM) -> dict[str, list[list[int]]]:
    """Every draft proposal per request since the engine started recording (the proposing
    stage keeps them: only their counts reach the engine)."""
    logs = [d for d in llm.llm_engine.executor.collective_rpc("draft_log") if d is not None]
    return logs[0] if logs else {}


def _metrics(llm: LLM) -> dict[str, object]:
    return {
        m.name: getattr(m, "values", None) or getattr(m, "value", None)
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
        or m.name.startswith("vllm:prefix_cache")
        or m.name == "vllm:prompt_tokens"
    }


def _run(model: str, prompt_rounds: list[list[list[int]]], caching: bool, **kw) -> Run:
    llm = LLM(model=model, enable_prefix_caching=caching, **{**COMMON, **kw})
    try:
        llm.llm_engine.executor.collective_rpc("record_drafts")
        outs = []
        for prompts in prompt_rounds:
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return Run(
            tokens=[o.outputs[0].token_ids for o in outs],
            logprobs=[
                [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
                for o in outs
            ],
            cached=[o.num_cached_tokens for o in outs],
            metrics=_metrics(llm),
            drafts=_draft_log(llm),
            num_preemptions=llm.llm_engine.scheduler.num_preemptions,
        )
    finally:
        llm.shutdown()


def _assert_same_outputs(on: Run, off: Run) -> None:
    assert on.tokens == off.tokens
    for a, b in zip(on.logprobs, off.logprobs):
        for da, db in zip(a, b):
            assert da.keys() == db.keys()
            for t in da:
                assert da[t] == pytest.approx(db[t], abs=2e-4)


def _assert_same_speculation(on: Run, off: Run) -> None:
    assert on.drafts == off.drafts
    assert any(on.drafts.values())
    for name in SPEC_METRICS:
        assert on.metrics[name] == off.metrics[name], name


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_dir(deepseek_v3_mtp1_dir, tmp_path_factory) -> str:
    """DeepSeek-V3 (MLA) whose MTP head partly agrees with the target and keeps its own
    attention (scaled), so drafts depend on the draft's KV and acceptance is neither 0 nor 1."""
    return make_mtp_self_draft(
        tmp_path_factory.mktemp("apc_mtp"),
        deepseek_v3_mtp1_dir,
        target_scale=0.3,
        draft_block_scale=0.5,
    )


@pytest.fixture(scope="module")
def eagle3_dir(llama_dir, tmp_path_factory) -> str:
    return make_eagle3_draft(tmp_path_factory.mktemp("apc_e3"), llama_dir, aux_layers=(1, 2, 3))


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory) -> str:
    """V3.2 with one MTP layer (index_topk 8: the indexer really selects)."""
    return make_deepseek_v32(tmp_path_factory.mktemp("apc_dsa"), num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompt_set(512)


def _case(request, name: str) -> tuple[str, dict]:
    if name == "llama":
        return request.getfixturevalue("llama_dir"), {}
    if name == "mla_mtp":
        return request.getfixturevalue("mtp_dir"), {
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 2,
        }
    if name == "dsa_mtp":
        return request.getfixturevalue("dsa_dir"), {
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 2,
        }
    assert name == "llama_eagle3"
    spec = {"method": "eagle3", "model": request.getfixturevalue("eagle3_dir")}
    return request.getfixturevalue("llama_dir"), {
        **spec,
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": 2,
    }


_OFF: dict[str, Run] = {}


def _off(request, name: str, prompts) -> Run:
    """Caching off at P = 1: the reference of every comparison below."""
    if name not in _OFF:
        model, spec = _case(request, name)
        _OFF[name] = _run(model, [prompts, prompts], False, speculative_config=spec or None)
    return _OFF[name]


# ---- on == off ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mla_mtp", "dsa_mtp", "llama_eagle3"])
def test_caching_on_equals_off(request, prompts, name):
    model, spec = _case(request, name)
    off = _off(request, name, prompts)
    on = _run(model, [prompts, prompts], True, speculative_config=spec or None)
    _assert_same_outputs(on, off)
    if spec:
        _assert_same_speculation(on, off)
    # Round 1 (all prompts in one step): hits exactly where a brute-force prefix match says,
    # including hits on blocks computed in that same step. Round 2: each prompt's own blocks.
    n = len(prompts)
    assert on.cached[:n] == _expected_first_round_hits(prompts, 1 if spec else 0)
    assert on.cached[n:] == [(len(p) - 1) // BS * BS for p in prompts]
    assert off.cached == [0] * 2 * n
    assert on.metrics["vllm:prefix_cache_queries"] == 2 * sum(len(p) for p in prompts)
    assert on.metrics["vllm:prefix_cache_hits"] == sum(on.cached) > 0
    assert off.metrics["vllm:prefix_cache_hits"] == 0
    assert on.metrics["vllm:prompt_tokens"] == off.metrics["vllm:prompt_tokens"]


@pytest.mark.parametrize("name", ["mla_mtp", "llama_eagle3"])
def test_caching_on_pp2_equals_off_pp1(request, prompts, name):
    """Two stages with two batches in flight: requests hit blocks a batch still in flight is
    writing (stages run batches in order), drafts and acceptance stay those of P = 1 without
    caching."""
    model, spec = _case(request, name)
    off = _off(request, name, prompts)
    on = _run(model, [prompts, prompts], True, speculative_config=spec, pipeline_parallel_size=2)
    _assert_same_outputs(on, off)
    _assert_same_speculation(on, off)
    # The second of the two batches in flight hits blocks the first is still computing.
    n = len(prompts)
    assert on.cached[:n] == _expected_first_round_hits(prompts, 1)
    assert on.cached[n:] == [(len(p) - 1) // BS * BS for p in prompts]


def test_dsa_pp2_equals_off_pp1(request, prompts):
    off = _off(request, "dsa_mtp", prompts)
    model, spec = _case(request, "dsa_mtp")
    on = _run(model, [prompts], True, speculative_config=spec, pipeline_parallel_size=2)
    n = len(prompts)
    assert on.tokens == off.tokens[:n]
    assert on.drafts == {r: d for r, d in off.drafts.items() if int(r) < n}
    assert on.cached == _expected_first_round_hits(prompts, 1)


@pytest.mark.parametrize("name", ["llama", "mla_mtp"])
def test_chunked_prefill_with_caching(request, prompts, name):
    """An 8-token budget: prompts are prefilled in chunks, a chunk's full blocks are cached as
    it is scheduled and hit by requests admitted later."""
    model, spec = _case(request, name)
    off = _off(request, name, prompts)
    kw = dict(speculative_config=spec or None, max_num_batched_tokens=8, max_num_seqs=4)
    on = _run(model, [prompts, prompts], True, **kw)
    _assert_same_outputs(on, off)
    if spec:
        # The budget trims drafts differently when caching changes the schedule, so later
        # proposals may differ; each request's first, made right after its (chunked, partly
        # cached) prefill from the draft KV of the whole prompt, may not.
        assert {r: d[0] for r, d in on.drafts.items()} == {r: d[0] for r, d in off.drafts.items()}
    assert sum(on.cached) > 0


@pytest.mark.parametrize("name", ["llama", "mla_mtp"])
def test_preemption_with_caching(request, prompts, name):
    """A KV cache too small for the batch: requests are preempted and, resumed, find their
    own (and others') blocks again; outputs stay those of an uncontended run without caching."""
    model, spec = _case(request, name)
    off = _off(request, name, prompts)
    # 24 blocks of 4 tokens: the longest request (30 + 8 + drafts) fits alone.
    # max_model_len: the pool's tokens less the drafts' lookahead (start-up refuses more).
    k = spec["num_speculative_tokens"] if spec else 0
    kw = dict(speculative_config=spec or None, num_gpu_blocks_override=24, max_model_len=96 - k)
    on = _run(model, [prompts, prompts], True, **kw)
    _assert_same_outputs(on, off)
    assert on.num_preemptions > 0
    assert sum(on.cached) > 0


# ---- eviction, sharing with a running request --------------------------------------------------


def _alone(llm: LLM, prompt: list[int], sp: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def test_eviction_more_prefixes_than_the_cache_holds(llama_dir):
    """20 blocks; six distinct 18-token prompts (7 blocks each with their outputs) run one after
    another, then the last and the first again: the last finds its 4 full prompt blocks, the
    first was evicted (LRU) and finds nothing; outputs equal caching off."""
    prompts = make_prompts(512, [18] * 6, seed=21)
    order = prompts + [prompts[-1], prompts[0]]
    ref = LLM(model=llama_dir, enable_prefix_caching=False, **COMMON)
    try:
        expected = [_alone(ref, p).outputs[0].token_ids for p in order]
    finally:
        ref.shutdown()
    llm = LLM(model=llama_dir, num_gpu_blocks_override=20, **{**COMMON, "max_model_len": 80})
    try:
        outs = [_alone(llm, p) for p in order]
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [o.num_cached_tokens for o in outs] == [0] * 6 + [16, 0]
        m = _metrics(llm)
        assert m["vllm:prefix_cache_queries"] == 18 * 8
        assert m["vllm:prefix_cache_hits"] == 16
        # All at once (with their repeats): preemption and eviction interleave, still correct.
        batch = llm.generate([{"prompt_token_ids": p} for p in order], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in batch] == expected
    finally:
        llm.shutdown()


def test_prefix_shared_with_a_running_request(llama_dir):
    """b arrives while a decodes and starts on a's blocks (reference count 2); a finishes
    while b runs, and a new request c needs memory: a's own blocks are evicted, the shared ones
    (still held by b) are not, and b's output is that of b alone without caching."""
    base = make_prompts(512, [30], seed=31)[0]
    pa, pb = base, base[:21] + make_prompts(512, [6], seed=32)[0]
    pc = make_prompts(512, [30], seed=33)[0]
    sa = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    sb = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(model=llama_dir, enable_prefix_caching=False, **COMMON)
    try:
        expected = [_alone(ref, p, sp).outputs[0].token_ids for p, sp in [(pa, sa), (pb, sb)]]
        expected.append(_alone(ref, pc, sa).outputs[0].token_ids)
    finally:
        ref.shutdown()
    # 19 blocks: b (10 with its outputs, 5 of them a's) + c (9) fit only by evicting a's own.
    llm = LLM(model=llama_dir, num_gpu_blocks_override=19, **{**COMMON, "max_model_len": 76})
    eng = llm.llm_engine
    kvm = eng.scheduler.kv_cache_manager
    done = {}
    try:
        eng.add_request("a", {"prompt_token_ids": pa}, sa)
        for _ in range(2):
            eng.step()
        eng.add_request("b", {"prompt_token_ids": pb}, sb)
        eng.step()
        b_blocks = kvm.get_block_ids("b")
        shared = kvm.get_block_ids("a")[:5]
        assert b_blocks[:5] == shared and eng.scheduler.requests["b"].num_cached_tokens == 20
        assert [kvm.pool.ref_cnt[x] for x in shared] == [2] * 5
        hashes = eng.scheduler.requests["a"].block_hashes
        while "a" not in done:
            done.update({o.request_id: o for o in eng.step() if o.finished})
        assert [kvm.pool.ref_cnt[x] for x in shared] == [1] * 5
        eng.add_request("c", {"prompt_token_ids": pc}, sa)
        while eng.has_unfinished_requests():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        assert [kvm.pool.lookup(h) for h in hashes[:5]] == shared
        assert any(kvm.pool.lookup(h) is None for h in hashes[5:])  # evicted for c (and b)
        assert eng.scheduler.num_preemptions == 0
        assert [done[r].outputs[0].token_ids for r in "abc"] == expected
    finally:
        llm.shutdown()


# ---- what bypasses or separates the cache ------------------------------------------------------


def test_prompt_logprobs_bypass_the_cache(llama_dir):
    prompt = make_prompts(512, [21], seed=41)[0]
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    ref = LLM(model=llama_dir, enable_prefix_caching=False, **COMMON)
    try:
        want = _alone(ref, prompt, sp).prompt_logprobs
    finally:
        ref.shutdown()
    llm = LLM(model=llama_dir, **COMMON)
    try:
        assert _alone(llm, prompt).num_cached_tokens == 0
        out = _alone(llm, prompt, sp)
        assert out.num_cached_tokens == 0
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for got, exp in zip(out.prompt_logprobs[1:], want[1:]):
            assert got.keys() == exp.keys()
            for t in got:
                assert got[t].logprob == pytest.approx(exp[t].logprob, abs=1e-4)
        assert _alone(llm, prompt).num_cached_tokens == 20  # the cache itself is still used
    finally:
        llm.shutdown()


def test_cache_salt_and_reset(llama_dir):
    prompt = make_prompts(512, [13], seed=51)[0]
    llm = LLM(model=llama_dir, **COMMON)
    try:

        def cached(salt=None):
            p = {"prompt_token_ids": prompt}
            if salt is not None:
                p["cache_salt"] = salt
            return llm.generate([p], GREEDY, use_tqdm=False)[0].num_cached_tokens

        assert [cached("a"), cached("b"), cached("a"), cached(), cached()] == [0, 0, 12, 0, 12]
        with pytest.raises(TypeError, match="cache_salt"):
            cached(3)
        assert llm.reset_prefix_cache()
        assert cached() == 0
        eng = llm.llm_engine
        eng.add_request("x", {"prompt_token_ids": prompt}, GREEDY)
        eng.step()
        assert eng.scheduler.requests["x"].num_cached_tokens == 12
        assert not llm.reset_prefix_cache()  # "x" holds blocks
        while eng.has_unfinished_requests():
            eng.step()
        assert llm.reset_prefix_cache()
        m = _metrics(llm)
        assert m["vllm:prefix_cache_hits"] == 12 + 12 + 12
    finally:
        llm.shutdown()


# ---- configuration -----------------------------------------------------------------------------


def test_flag_default_and_metric_names(llama_dir):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).enable_prefix_caching is None
    assert parser.parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    cfg = args.replace(model=llama_dir).create_engine_config()
    assert cfg.cache_config.enable_prefix_caching is True  # vLLM's default
    llm = LLM(model=llama_dir, **COMMON)
    try:
        text = generate_latest(llm.llm_engine.prom.registry).decode()
        assert "vllm:prefix_cache_queries_total{" in text
        assert "vllm:prefix_cache_hits_total{" in text
    finally:
        llm.shutdown()
