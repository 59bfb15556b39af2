# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The linear-attention state checkpoints of hybrid prefix caching, at the scheduler level (pure
Python): which block boundaries a step saves, when a saved checkpoint becomes readable, how a
hit is cut back to a checkpointed boundary, and eviction (LRU, and with the KV block)."""

from __future__ import annotations

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.state_checkpoints import StateCheckpointPool
from vllm.v1.request import Request

B = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), seed=0)


def test_boundaries_align_all_and_junction():
    pool = StateCheckpointPool(8, B, "align")
    assert pool.boundaries("a", 0, 3) == []
    assert pool.boundaries("a", 0, 13) == [12]  # the last boundary the step reaches
    assert pool.boundaries("a", 12, 16) == [16]
    # A request that started after a 3-block cached run keeps its end too.
    pool.limit_hit("b", [b"x", b"y", b"z"], 3)
    assert pool.boundaries("b", 0, 17) == [12, 16]
    assert StateCheckpointPool(8, B, "all").boundaries("a", 5, 17) == [8, 12, 16]


def _manager(num_blocks=16, ckpts=4, extra=0) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        B,
        num_state_slots=4,
        enable_caching=True,
        num_lookahead_tokens=extra,
        num_state_checkpoints=ckpts,
    )


def _prefill(kvm: KVCacheManager, req: Request) -> list[tuple[int, int]]:
    kvm.checkpoints.new_step()
    hits, n_hit = kvm.get_computed_blocks(req)
    n = req.num_tokens - n_hit
    assert kvm.allocate_slots(req, n, 0, hits) is not None
    req.num_computed_tokens = n_hit
    saves = kvm.plan_checkpoints(req, n_hit, n_hit + n)
    req.num_computed_tokens += n
    return saves


def test_hit_needs_a_readable_checkpoint():
    kvm = _manager()
    a = _req("a", list(range(1, 15)))  # 14 tokens: blocks end at 4, 8, 12
    assert _prefill(kvm, a) == [(12, 0)]
    # Same step: the KV blocks are there, the state is not written yet.
    same = _req("same", a.prompt_token_ids)
    assert kvm.get_computed_blocks(same) == ([], 0)
    kvm.free(a)
    kvm.checkpoints.new_step()
    again = _req("again", a.prompt_token_ids)
    hits, n = kvm.get_computed_blocks(again)
    assert n == 12 and kvm.restore_checkpoint(again, n) == 0
    # A prompt sharing 10 tokens: 2 cached blocks, none checkpointed, so no hit; its step
    # saves the junction (8) besides its own last boundary.
    other = _req("other", list(range(1, 11)) + [99, 98, 97])
    saves = _prefill(kvm, other)
    assert [p for p, _ in saves] == [8, 12]
    assert other.num_computed_tokens == 13  # it computed everything
    kvm.checkpoints.new_step()
    third = _req("third", list(range(1, 11)) + [50, 51])
    assert kvm.get_computed_blocks(third)[1] == 8


def test_checkpoints_evicted_lru_and_with_their_block():
    kvm = _manager(num_blocks=8, ckpts=1)
    a, b = _req("a", list(range(1, 11))), _req("b", list(range(20, 30)))
    _prefill(kvm, a)
    kvm.free(a)
    _prefill(kvm, b)  # takes the only checkpoint (LRU): a's is gone although its KV is not
    kvm.free(b)
    kvm.checkpoints.new_step()
    assert kvm.get_computed_blocks(_req("a2", a.prompt_token_ids))[1] == 0
    assert kvm.get_computed_blocks(_req("b2", b.prompt_token_ids))[1] == 8
    # b's KV blocks evicted by a bigger request: its checkpoint is dropped with them.
    big = _req("big", list(range(40, 72)))
    assert kvm.allocate_slots(big, 32) is not None
    assert kvm.checkpoints.num_registered == 0
    assert kvm.checkpoints.readable(b.block_hashes[1]) is None


def test_lookahead_checkpoint_waits_for_its_block_hash():
    """With a draft's lookahead a block's hash needs the token after it: a boundary reached
    before that token is known is saved now and registered once the block is."""
    kvm = _manager(extra=1)
    a = _req("a", list(range(1, 9)))  # 8 tokens: block 1's hash needs token 8 (unknown)
    saves = _prefill(kvm, a)
    assert saves == [(8, 0)]
    assert kvm.checkpoints.num_registered == 0
    a.append_output_token_ids(77)
    kvm.free(a)  # registers block 1 now that token 8 is known, and its checkpoint
    assert kvm.checkpoints.num_registered == 1
    kvm.checkpoints.new_step()
    assert kvm.get_computed_blocks(_req("b", list(range(1, 9)) + [77, 5]))[1] == 8


def test_hybrid_without_checkpoints_never_resumes():
    """A hybrid's scheduler without checkpoints (the warm-up's) finds the KV blocks but has no
    states to resume with: no hit."""
    kvm = _manager(ckpts=0)
    a = _req("a", list(range(1, 15)))
    assert _prefill(kvm, a) == []
    kvm.free(a)
    assert kvm.pool.num_cached_blocks == 3
    assert kvm.get_computed_blocks(_req("b", a.prompt_token_ids)) == ([], 0)
