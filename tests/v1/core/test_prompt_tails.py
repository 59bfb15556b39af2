# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Cached prompt tails at the KV manager level (pure Python): a prompt that does not end on a
block boundary caches its partial last block and a state checkpoint there; a later prompt
extending it resumes at that prompt's end, from its own copy of the partial block (the copy is
listed for the workers; the source is never handed to the new request), only from the next
step, never for a prompt that would leave nothing to compute; eviction of the block forgets
the tail and its checkpoint, and a tail without a readable checkpoint is not used."""

from __future__ import annotations

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

B = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), seed=0)


def _manager(num_blocks=16, ckpts=4, extra=0, tails=True, slots=4) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        B,
        num_state_slots=slots,
        enable_caching=True,
        num_lookahead_tokens=extra,
        num_state_checkpoints=ckpts,
        cache_prompt_tails=tails,
    )


def _prefill(kvm: KVCacheManager, req: Request):
    """One step scheduling the whole prompt after its hit: (hit tokens, saves, copies, ckpt)."""
    kvm.checkpoints.new_step()
    hits, n_hit = kvm.get_computed_blocks(req)
    n = req.num_tokens - n_hit
    assert kvm.allocate_slots(req, n, 0, hits) is not None
    req.num_computed_tokens = n_hit
    ckpt = kvm.restore_checkpoint(req, n_hit)
    saves = kvm.plan_checkpoints(req, n_hit, n_hit + n)
    req.num_computed_tokens += n
    return n_hit, saves, kvm.take_block_copies(), ckpt


A = list(range(1, 11))  # 10 tokens: full blocks end at 4 and 8, the tail holds 9, 10


def test_tail_hit_copies_the_partial_block():
    kvm = _manager()
    a = _req("a", A)
    n_hit, saves, copies, _ = _prefill(kvm, a)
    assert (n_hit, copies) == (0, [])
    assert [p for p, _ in saves] == [8, 10]  # the last full block, and the prompt's end
    tail_ckpt = dict(saves)[10]
    a_blocks = kvm.get_block_ids("a")
    # The next turn: A + answer + message.
    turn = _req("t", A + [50, 51, 52])
    n_hit, saves, copies, ckpt = _prefill(kvm, turn)
    assert n_hit == 10 and ckpt == tail_ckpt
    t_blocks = kvm.get_block_ids("t")
    assert t_blocks[:2] == a_blocks[:2]  # full blocks shared
    assert t_blocks[2] != a_blocks[2]  # the partial one copied, never shared
    assert copies == [(a_blocks[2], t_blocks[2])]
    assert kvm.pool.ref_cnt[a_blocks[2]] == 1 and kvm.pool.ref_cnt[t_blocks[2]] == 1
    assert [p for p, _ in saves] == [12, 13]  # its own last boundary and prompt end
    # Two more extensions of A in one step: each gets its own copy.
    kvm.free(a)
    assert kvm.pool.ref_cnt[a_blocks[2]] == 0  # free, still cached (its tail)
    kvm.checkpoints.new_step()
    got = []
    for rid, tail in (("x", [60, 61]), ("y", [70, 71, 72])):
        r = _req(rid, A + tail)
        hits, n = kvm.get_computed_blocks(r)
        assert n == 10
        assert kvm.allocate_slots(r, r.num_tokens - n, 0, hits) is not None
        assert kvm.restore_checkpoint(r, n) == tail_ckpt
        got.append(kvm.get_block_ids(rid)[2])
    assert kvm.take_block_copies() == [(a_blocks[2], got[0]), (a_blocks[2], got[1])]
    assert len({a_blocks[2], *got}) == 3


def test_tail_rules():
    kvm = _manager()
    a = _req("a", A)
    _prefill(kvm, a)
    # Same step: the tail's KV and state are not written yet.
    assert kvm.get_computed_blocks(_req("s", A + [5]))[1] == 0
    kvm.checkpoints.new_step()
    # The same prompt again: its last token is computed, so only the block boundary hits.
    assert kvm.get_computed_blocks(_req("same", A))[1] == 8
    # A prompt that differs inside the tail: the block boundary.
    assert kvm.get_computed_blocks(_req("d", A[:9] + [99, 98]))[1] == 8
    # A salted prompt shares nothing.
    salted = Request("z", A + [1], SamplingParams(max_tokens=4), seed=0, cache_salt="s")
    assert kvm.get_computed_blocks(salted)[1] == 0
    # Off: block boundaries only.
    off = _manager(tails=False)
    _prefill(off, _req("a", A))
    assert _prefill(off, _req("t", A + [5, 6]))[0] == 8


def test_lookahead_tail_ends_before_the_last_prompt_token():
    """With a draft's lookahead (1): the tail ends one token before the prompt's end, keyed
    with that token (known), so the same prompt again hits all but its last token."""
    kvm = _manager(extra=1)
    a = _req("a", A)
    _, saves, _, _ = _prefill(kvm, a)
    assert 9 in [p for p, _ in saves]
    assert _prefill(kvm, _req("same", A))[0] == 9
    assert _prefill(kvm, _req("t", A + [7, 8]))[0] == 9
    assert _prefill(kvm, _req("d", A[:9] + [77, 78]))[0] == 8  # the lookahead token differs


def test_eviction_forgets_the_tail_and_its_checkpoint():
    kvm = _manager(num_blocks=6)
    a = _req("a", A)
    _, saves, _, _ = _prefill(kvm, a)
    kvm.free(a)
    assert len(kvm.tails) == 1 and kvm.checkpoints.num_registered == 2
    # 3 free blocks never used, then the LRU's oldest: A's partial block (freed first).
    b = _req("b", list(range(100, 116)))
    _prefill(kvm, b)
    # The tail's checkpoint went with its block; 8's stays, b's (16) came.
    assert len(kvm.tails) == 0 and kvm.checkpoints.num_registered == 2
    kvm.free(b)
    assert _prefill(kvm, _req("t", A + [5, 6]))[0] == 8
    # Checkpoints short: a tail's goes before any block boundary's (LRU among each), and a
    # tail whose checkpoint went is not used although its block is still cached.
    kvm = _manager(ckpts=2)
    _prefill(kvm, _req("a", A))  # checkpoints at 8 and 10 (the tail)
    _prefill(kvm, _req("c", [200, 201, 202, 203]))  # its checkpoint at 4 takes the tail's
    assert len(kvm.tails) == 1
    assert _prefill(kvm, _req("t", A + [5, 6]))[0] == 8


def test_attention_only_tails():
    """Without linear-attention states (no checkpoint needed) the manager caches tails too
    (not switched on for attention-only models, which keep vLLM's full-block hits), never in
    the step that computes the tail (the copy runs before that step's forward writes it)."""
    kvm = _manager(slots=0, ckpts=0)
    a = _req("a", A)
    _prefill(kvm, a)
    assert kvm.get_computed_blocks(_req("s", A + [5]))[1] == 8  # same step: full blocks only
    n_hit, _, copies, ckpt = _prefill(kvm, _req("t", A + [5, 6]))
    assert (n_hit, ckpt) == (10, -1) and len(copies) == 1
