# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Paged KV block accounting and automatic prefix caching (pure Python, no torch).

A request owns a list of block ids covering its computed tokens plus what is scheduled (and the
draft lookahead). Hybrid models also give each request one fixed-size state slot for their
linear-attention layers; blocks and the slot are allocated, preempted and freed together.

Prefix caching: every full block of a request gets a hash chained from its parent's, so equal
hashes mean equal token prefixes (and equal cache salt). A full block whose KV is computed is
registered under its hash; a new request whose leading block hashes are registered starts with
those blocks (shared, reference counted) instead of computing them. A freed block keeps its hash
and stays reusable in an LRU until its memory is needed for another request. Hybrid models
resume only after a block whose linear-attention states were checkpointed (state_checkpoints).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable

from vllm.v1.core.state_checkpoints import StateCheckpointPool
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


BlockHash = bytes


def root_block_hash(cache_salt: str | None, adapter: str | None = None) -> BlockHash:
    """Parent hash of a request's first block: requests with different salts, or different
    LoRA adapters (adapter: LoRARequest.cache_key), share nothing."""
    tag = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    if adapter is not None:
        tag += b"\x02" + adapter.encode("utf-8")
    return hashlib.sha256(b"vllm-prefix-cache" + tag).digest()


def hash_block_tokens(parent: BlockHash, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash (the chain commits to the whole prefix);
    extra: what the tokens alone do not say (the content hashes of the images whose
    placeholder tokens the block holds)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + extra).digest()


def block_mm_keys(request: Request, start: int, end: int) -> bytes:
    """Content hashes (and placeholder offsets) of the request's images overlapping token
    range [start, end): equal text with different images never shares a block."""
    mm = request.mm_inputs
    if mm is None:
        return b""
    keys = [
        f"{f.identifier}@{f.offset}".encode()
        for f in mm.features
        if f.offset < end and start < f.offset + f.length
    ]
    return b"|mm|" + b"|".join(keys) if keys else b""


class BlockPool:
    """KV block ids with reference counts.

    Free blocks live in two queues: never-cached ones (taken first), and blocks that still hold
    a registered prefix, in LRU order (evicted oldest first, and only when nothing else is
    free)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # Called with the hash of every block whose cached prefix is forgotten (evicted).
        self.on_uncache: Callable[[BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def take(self, n: int) -> list[int]:
        assert n <= self.num_free_blocks
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached_free.popitem(last=False)
                self._uncache(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks a request starts with."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._cached_free[b]
            self.ref_cnt[b] += 1

    def give_back(self, blocks: list[int]) -> None:
        """Drop one reference on each block; a block nobody holds becomes free. Pass a
        request's blocks tail first: cached ones then leave the LRU tail first, keeping the
        prefix (the part other requests share) longest."""
        uncached = []
        for b in blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} freed twice"
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is not None:
                    self._cached_free[b] = None
                else:
                    uncached.append(b)
        # Recently used memory is reused first.
        self._free.extendleft(uncached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._hash_to_block.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Register a computed full block; a prefix already registered keeps its block (this
        one stays private to its request and is freed uncached)."""
        if self.block_hash[block] is None and block_hash not in self._hash_to_block:
            self.block_hash[block] = block_hash
            self._hash_to_block[block_hash] = block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self._hash_to_block[h]
            self.block_hash[block] = None
            if self.on_uncache is not None:
                self.on_uncache(h)

    def reset_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use, since those
        blocks' KV may be reused by the requests holding them."""
        if any(self.ref_cnt):
            return False
        for b in list(self._cached_free):
            self._uncache(b)
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        return True

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
        enable_caching: bool = False,
        num_lookahead_tokens: int = 0,
        num_state_checkpoints: int = 0,
        mamba_cache_mode: str = "align",
    ) -> None:
        """num_state_checkpoints: hybrid models' linear-attention state checkpoints (a hit
        must end at a checkpointed block boundary).

        num_lookahead_tokens: a draft model writes KV into the same blocks, and its KV at a
        position is computed from up to that many tokens after it (1: the next token), so a
        block is only reusable by a request that also agrees on the first tokens of the next
        block; they join the block's hash (and a block is registered once they are known)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._free_state_slots: deque[int] = deque(range(num_state_slots))
        self.num_state_slots = num_state_slots
        self.req_to_state_slot: dict[str, int] = {}
        self.enable_caching = enable_caching
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        self._extra = num_lookahead_tokens
        # Leading blocks of each request already registered in the pool (or found duplicate).
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.checkpoints = StateCheckpointPool(
            num_state_checkpoints if enable_caching else 0, block_size, mamba_cache_mode
        )
        if self.checkpoints:
            self.pool.on_uncache = self.checkpoints.drop

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    # ---- prefix caching ------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's block hashes, extended (as far as its tokens allow) to num_blocks."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        B = self.block_size
        lora = request.lora_request
        parent = (
            hashes[-1]
            if hashes
            else root_block_hash(request.cache_salt, None if lora is None else lora.cache_key)
        )
        while len(hashes) < num_blocks:
            start = len(hashes) * B
            end = start + B + self._extra
            if end > len(tokens):
                break
            parent = hash_block_tokens(
                parent, tokens[start:end], block_mm_keys(request, start, end)
            )
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached leading blocks of a request that has computed nothing yet,
        and its token count. The last token is always left to compute (its logits sample the
        next token), so at most (num_tokens - 1) // block_size blocks hit."""
        if (
            not self.enable_caching
            or request.skip_reading_prefix_cache
            or request.num_computed_tokens > 0
        ):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._block_hashes(request, max_blocks)[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        if self.num_state_slots:
            # A hybrid resumes only where its linear-attention states were checkpointed (a
            # scheduler without checkpoints, e.g. the warm-up's, never resumes).
            n = 0
            if self.checkpoints:
                n = self.checkpoints.limit_hit(request.request_id, request.block_hashes, len(hits))
            hits = hits[:n]
        return hits, len(hits) * self.block_size

    def restore_checkpoint(self, request: Request, num_hit_tokens: int) -> int:
        """The state checkpoint a request starting after num_hit_tokens cached tokens resumes
        from (-1: none, it starts from scratch)."""
        if not self.checkpoints:
            return -1
        return self.checkpoints.restore(request.block_hashes, num_hit_tokens // self.block_size)

    def plan_checkpoints(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """(boundary, checkpoint id) of the states a step computing tokens [start, end) of the
        request saves; only boundaries its known tokens reach (never after a draft). A boundary
        <= start is one the last step passed on drafts accepted since: the workers copy it from
        the states that step kept."""
        if not self.checkpoints:
            return []
        hashes = self._block_hashes(request, min(end, request.num_tokens) // self.block_size)
        out = []
        for p in self.checkpoints.boundaries(
            request.request_id, start, min(end, request.num_tokens)
        ):
            ckpt = self.checkpoints.save(
                request.request_id, p, hashes, lambda h: self.pool.lookup(h) is not None
            )
            if ckpt is not None:
                out.append((p, ckpt))
        return out

    def record_prefix_cache_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.num_preemptions > 0
            )

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.enable_caching:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def _cache_full_blocks(self, request: Request, num_computed: int) -> None:
        """Register the request's full blocks whose KV is final once num_computed tokens are:
        blocks of known tokens only (never of unverified drafts) and, with lookahead tokens,
        only once the tokens after the block are known too."""
        rid = request.request_id
        num_final = min(num_computed, request.num_tokens - self._extra)
        num_full = num_final // self.block_size
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        blocks = self.req_to_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached_blocks[rid] = num_full
        if self.checkpoints:
            self.checkpoints.on_blocks_cached(rid, hashes, num_full)

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_cache()
        if ok:
            self.prefix_cache_stats.reset = True
        return ok

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Blocks for num_computed + cached + num_new (+ lookahead) tokens; returns the ids added
        to the request, or None (and changes nothing) when the pool cannot cover them.

        new_computed_blocks: cached blocks (from get_computed_blocks) the request starts with;
        the caller then counts their tokens as computed. The KV of the scheduled tokens is
        assumed written by the step this allocation is for: full blocks of known tokens are
        registered now, so a request scheduled later (even in the same step, or while that step
        is still in flight) can hit them. That is safe because every pipeline stage runs steps
        in the order they were scheduled and, within a step, writes all new KV before any
        attention reads it."""
        hits = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(blocks) - len(hits)
        # Cached blocks nobody holds leave the free pool when this request takes them.
        num_free = self.pool.num_free_blocks - sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        needs_slot = self.num_state_slots and rid not in self.req_to_state_slot
        if need > num_free or (needs_slot and not self._free_state_slots):
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        if needs_slot:
            self.req_to_state_slot[rid] = self._free_state_slots.popleft()
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self._num_cached_blocks[rid] = len(blocks)
        new = self.pool.take(need) if need > 0 else []
        blocks.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return hits + new

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks. Blocks that became final since the
        last allocation (with lookahead tokens, the one completed by the last sampled token) are
        registered first, so a preempted request finds all of its prefix again."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and self.enable_caching:
            self._cache_full_blocks(request, request.num_computed_tokens)
        self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.give_back(blocks[::-1])
        self.checkpoints.free_request(request.request_id)
        slot = self.req_to_state_slot.pop(request.request_id, None)
        if slot is not None:
            self._free_state_slots.appendleft(slot)

    def usage(self) -> float:
        return self.pool.usage()
