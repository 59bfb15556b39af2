# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Prefix caching without a model (pure Python): block hashing, the cached-block LRU, reference
counts, what the scheduler skips, and a simulated worker that checks, for random workloads with
shared prefixes, chunked prefill, speculation, preemption, eviction and steps in flight, that
every KV position a step reads holds what its own tokens would have written."""

from __future__ import annotations

import random

import pytest

from tests.v1.core.utils import answer as _answer
from tests.v1.core.utils import make_request, sched_config
from vllm.v1.core.kv_cache_manager import (
    BlockPool,
    KVCacheManager,
    hash_block_tokens,
    root_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus


def _config(num_seqs=8, budget=64, max_model_len=256, block_size=4, k=0, caching=True):
    return sched_config(num_seqs, budget, max_model_len, block_size, k, caching)


def _req(rid, tokens, max_tokens=4, salt=None, prompt_logprobs=None):
    return make_request(rid, tokens, max_tokens, salt, prompt_logprobs)


def _run_to_end(s: Scheduler) -> None:
    for _ in range(1000):
        if not s.has_unfinished_requests():
            return
        so = s.schedule()
        s.update_from_output(so, _answer(so))
    raise AssertionError("requests did not finish")


# ---- hashing -----------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_whole_prefix():
    m = KVCacheManager(64, 4, enable_caching=True)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    c = _req("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    ha, hb, hc = (m._block_hashes(r, 10) for r in (a, b, c))
    assert len(ha) == 2  # only full blocks
    assert ha == hb
    # A different first token changes every later hash: equal blocks after it are not shared.
    assert hc[0] != ha[0] and hc[1] != ha[1]
    assert ha[0] == hash_block_tokens(root_block_hash(None), [1, 2, 3, 4])


def test_cache_salt_separates_requests():
    m = KVCacheManager(64, 4, enable_caching=True)
    toks = list(range(1, 10))
    h = [m._block_hashes(_req(str(i), toks, salt=s), 2) for i, s in enumerate([None, "x", "y"])]
    assert len({tuple(x) for x in h}) == 3
    assert m._block_hashes(_req("z", toks, salt="x"), 2) == h[1]


def test_next_token_hashing_needs_the_token_after_the_block():
    m = KVCacheManager(64, 4, enable_caching=True, num_lookahead_tokens=1)
    # 8 tokens: block 1 has no next token yet, so only block 0 is hashable.
    assert len(m._block_hashes(_req("a", range(1, 9)), 2)) == 1
    # Same block, different next token: different hash (the draft's KV there differs).
    x = m._block_hashes(_req("x", [1, 2, 3, 4, 5]), 1)
    y = m._block_hashes(_req("y", [1, 2, 3, 4, 6]), 1)
    assert x != y


# ---- block pool --------------------------------------------------------------------------------


def test_pool_prefers_uncached_blocks_and_evicts_lru_tail_first():
    p = BlockPool(6)
    a = p.take(3)
    for i, b in enumerate(a):
        p.cache(b, bytes([i]))
    p.give_back(a[::-1])  # a request frees its blocks tail first
    assert p.num_free_blocks == 6 and p.num_cached_blocks == 3
    assert p.take(3) == [3, 4, 5]  # never-cached blocks first
    assert p.num_cached_blocks == 3
    # Then the LRU: the request's tail block goes first, its first block last.
    assert p.take(1) == [a[2]]
    assert p.lookup(bytes([2])) is None and p.lookup(bytes([0])) == a[0]


def test_pool_ref_counts_and_touch():
    p = BlockPool(4)
    b = p.take(1)[0]
    p.cache(b, b"h")
    p.touch([b])  # a second request shares it
    assert p.ref_cnt[b] == 2
    p.give_back([b])
    assert p.ref_cnt[b] == 1 and p.num_free_blocks == 3
    p.give_back([b])
    assert p.num_free_blocks == 4 and p.lookup(b"h") == b  # free but still cached
    p.touch([b])  # a hit on a free cached block takes it out of the free list
    assert p.num_free_blocks == 3 and p.take(3) == [1, 2, 3]


def test_pool_keeps_the_first_block_registered_for_a_hash():
    p = BlockPool(4)
    x, y = p.take(2)
    p.cache(x, b"h")
    p.cache(y, b"h")
    assert p.lookup(b"h") == x and p.block_hash[y] is None


def test_reset_refused_while_blocks_are_in_use():
    m = KVCacheManager(8, 4, enable_caching=True)
    r = _req("a", range(1, 10))
    assert m.allocate_slots(r, 9) is not None
    assert m.pool.num_cached_blocks == 2
    assert not m.reset_prefix_cache()
    r.num_computed_tokens = 9
    m.free(r)
    assert m.reset_prefix_cache()
    assert m.pool.num_cached_blocks == 0 and m.pool.num_free_blocks == 8
    assert m.get_computed_blocks(_req("b", range(1, 10))) == ([], 0)


# ---- scheduler ---------------------------------------------------------------------------------


def test_shared_prefix_is_skipped_and_blocks_are_shared():
    s = Scheduler(_config(), num_blocks=32)
    s.add_request(_req("a", range(1, 12), max_tokens=8))
    so = s.schedule()
    s.update_from_output(so, _answer(so))
    # "b" shares a's first 9 tokens: two full blocks (8 tokens) hit, while "a" still runs.
    s.add_request(_req("b", list(range(1, 10)) + [50, 51]))
    so = s.schedule()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 3
    a_blocks = s.kv_cache_manager.get_block_ids("a")
    assert new.block_ids[:2] == a_blocks[:2] and new.block_ids[2] not in a_blocks
    assert [s.kv_cache_manager.pool.ref_cnt[b] for b in a_blocks[:2]] == [2, 2]
    assert s.requests["b"].num_cached_tokens == 8
    res = s.update_from_output(so, _answer(so))
    assert res.stats.prefix_cache_stats.queries == 11 and res.stats.prefix_cache_stats.hits == 8
    assert res.outputs["b"].num_cached_tokens == 8
    # Cached prompt tokens still count as processed prompt tokens (as vLLM counts them).
    assert so.num_prompt_tokens == 11 + 1 - 1  # b's 11 prompt tokens; a decodes
    _run_to_end(s)
    assert s.kv_cache_manager.pool.num_free_blocks == 32


@pytest.mark.parametrize("n, expected", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_last_token_is_always_recomputed(n, expected):
    s = Scheduler(_config(), num_blocks=32)
    s.add_request(_req("a", range(1, n + 1), max_tokens=1))
    _run_to_end(s)
    s.add_request(_req("b", range(1, n + 1), max_tokens=1))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == expected
    assert so.num_scheduled_tokens["b"] == n - expected


def test_prompt_logprobs_requests_do_not_read_the_cache():
    s = Scheduler(_config(), num_blocks=32)
    s.add_request(_req("a", range(1, 14), max_tokens=1))
    _run_to_end(s)
    s.add_request(_req("b", range(1, 14), max_tokens=1, prompt_logprobs=1))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    res = s.update_from_output(so, _answer(so))
    assert res.stats.prefix_cache_stats.hits == 0
    assert res.stats.prefix_cache_stats.queries == 13


def test_caching_off_changes_nothing():
    s = Scheduler(_config(caching=False), num_blocks=32)
    s.add_request(_req("a", range(1, 14), max_tokens=1))
    _run_to_end(s)
    s.add_request(_req("b", range(1, 14), max_tokens=1))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert s.kv_cache_manager.pool.num_cached_blocks == 0
    assert s.update_from_output(so, _answer(so)).stats.prefix_cache_stats is None


def test_preempted_request_hits_its_own_blocks_counted_apart():
    # 6 blocks of 4 tokens: two 10-token prompts that grow until one is preempted.
    s = Scheduler(_config(), num_blocks=6)
    a, b = _req("a", range(1, 11), max_tokens=8), _req("b", range(20, 30), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    resumed, stats = [], []
    for _ in range(60):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for nr in so.scheduled_new_reqs:
            if nr.req_id == "b" and b.num_preemptions:
                resumed.append(nr.num_computed_tokens)
        stats.append(s.update_from_output(so, _answer(so)).stats.prefix_cache_stats)
    assert b.num_preemptions >= 1 and resumed
    # Resumed, b finds what is left of its own blocks (a's growth evicted some of them).
    assert resumed[0] > 0
    assert sum(x.preempted_hits for x in stats) == sum(resumed)
    assert sum(x.preempted_requests for x in stats) == len(resumed)
    assert sum(x.queries for x in stats) == 20 and sum(x.hits for x in stats) == 0
    assert a.is_finished() and b.is_finished()


def test_draft_mode_registers_a_block_once_its_next_token_is_known():
    s = Scheduler(_config(k=1), num_blocks=32)
    r = _req("a", range(1, 9), max_tokens=4)  # 8 tokens: two full blocks
    s.add_request(r)
    so = s.schedule()
    # Block 1 ends at the last prompt token; its next token is not sampled yet.
    assert s.kv_cache_manager.pool.num_cached_blocks == 1
    s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[9]], None, {}, [1]))
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # Freed with token 8 known: block 1 is registered too.
    assert s.kv_cache_manager.pool.num_cached_blocks == 2
    s.add_request(_req("b", list(range(1, 9)) + [9, 1]))
    s.add_request(_req("c", list(range(1, 9)) + [3, 1]))
    so = s.schedule()
    hits = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    assert hits == {"b": 8, "c": 4}  # c agrees on block 1 but not on the token after it


# ---- simulated worker --------------------------------------------------------------------------


class _SimWorker:
    """Mirrors the model runner's block tables and writes, per KV slot, what a model would
    store there: the token prefix ending at that position (and with a draft, the token after
    it). Reading a slot whose content is not the reader's own prefix is a caching bug. Like
    the model runner, it keeps its drafts and verifies the first ones the scheduler counts."""

    def __init__(self, num_blocks, block_size, k, vocab, seed):
        self.B, self.k, self.vocab = block_size, k, vocab
        self.content: list[object] = [None] * (num_blocks * block_size)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        self.rng = random.Random(seed)
        self.num_reads = 0

    def next_token(self, prefix: list[int]) -> int:
        return hash(tuple(prefix)) % self.vocab  # a deterministic "greedy model"

    def slot(self, rid, pos):
        return self.tables[rid][pos // self.B] * self.B + pos % self.B

    def execute(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.drafts.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids)
            self.tokens[nr.req_id] = list(nr.prefill_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
        cr = so.scheduled_cached_reqs
        for rid, blocks, nc in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens):
            self.tables[rid] += blocks
            assert self.computed[rid] == nc
        ids = so.req_ids
        sampled, drafts = [], []
        for rid in ids:
            toks, c, n = self.tokens[rid], self.computed[rid], so.num_scheduled_tokens[rid]
            spec = self.drafts.get(rid, [])[: so.num_draft_tokens.get(rid, 0)]
            seq = toks + spec
            # Every context position this step attends to must hold this request's prefix.
            for p in range(c):
                assert self.content[self.slot(rid, p)] == self._expected(toks, p), (rid, p)
                self.num_reads += 1
            out: list[int] = []
            if c + n >= len(toks):  # the last known token is in this step: sample
                for j in range(len(spec) + 1):
                    t = self.next_token(toks + out)
                    out.append(t)
                    if j < len(spec) and spec[j] != t:
                        break
            final = toks + out
            last_valid = len(toks) - 1 + len(out)  # positions < this have true next tokens
            for p in range(c, c + n):
                if p < last_valid:
                    # Target KV of a real token; a draft's KV also sees the true next token.
                    self.content[self.slot(rid, p)] = self._expected(final, p)
                else:
                    self.content[self.slot(rid, p)] = ("garbage", seq[p] if p < len(seq) else 0)
            if out:
                self.computed[rid] = c + n - (len(spec) + 1 - len(out))
                toks += out
            else:
                self.computed[rid] = c + n
            sampled.append(out)
            d = []
            if out and self.k:
                # Drafts: right half of the time, so some are accepted and some rolled back.
                for _ in range(self.k):
                    good = self.next_token(toks + d)
                    d.append(good if self.rng.random() < 0.6 else (good + 1) % self.vocab)
            if out:
                self.drafts[rid] = d
            drafts.append(len(d))
        return ModelRunnerOutput(
            ids, {r: i for i, r in enumerate(ids)}, sampled, None, {}, drafts if self.k else None
        )

    def _expected(self, toks, p):
        prefix = tuple(toks[: p + 1])
        return (prefix, toks[p + 1]) if self.k else prefix


def _simulate(seed, k, num_blocks, in_flight, block_size=4):
    rng = random.Random(seed)
    cfg = _config(num_seqs=6, budget=24, block_size=block_size, k=k)
    s = Scheduler(cfg, num_blocks=num_blocks)
    w = _SimWorker(num_blocks, block_size, k, vocab=5, seed=seed)
    systems = [[rng.randrange(5) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    pending = []
    for i in range(40):
        base = rng.choice(systems)
        prompt = base[: rng.randrange(1, len(base) + 1)] + [
            rng.randrange(5) for _ in range(rng.randrange(0, 6))
        ]
        pending.append(_req(str(i), prompt, max_tokens=rng.randrange(1, 8)))
    queue = []
    steps = 0
    hits = 0
    while pending or s.has_unfinished_requests() or queue:
        steps += 1
        assert steps < 3000
        for _ in range(rng.randrange(0, 3)):
            if pending:
                s.add_request(pending.pop(0))
        if len(queue) < in_flight:
            so = s.schedule(max_num_reqs=3 if in_flight > 1 else None)
            if so.total_num_scheduled_tokens or so.finished_req_ids:
                hits += sum(nr.num_computed_tokens for nr in so.scheduled_new_reqs)
                queue.append((so, w.execute(so)))
                if len(queue) < in_flight and so.total_num_scheduled_tokens:
                    continue
        if queue:
            so, out = queue.pop(0)
            s.update_from_output(so, out)
    assert s.kv_cache_manager.pool.num_free_blocks == num_blocks
    return hits, w.num_reads, s.num_preemptions


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("num_blocks", [24, 200])
def test_simulated_worker_only_reads_its_own_prefix(k, in_flight, num_blocks):
    total_hits = 0
    for seed in range(4):
        hits, reads, _ = _simulate(seed, k, num_blocks, in_flight)
        total_hits += hits
        assert reads > 0
    assert total_hits > 0  # the workload does exercise the cache
