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
resume only after a block whose linear-attention states were checkpointed (state_checkpoints),
or after a cached prompt tail (prompt_tails.py: a partial last block, copied on write).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.prompt_tails import PromptTails, TailHit, tail_key
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
        cache_prompt_tails: bool = False,
    ) -> None:
        """num_state_checkpoints: hybrid models' linear-attention state checkpoints (a hit
        must end at a checkpointed block boundary).

        cache_prompt_tails: also cache the partial last block of each prompt (prompt_tails.py;
        a hybrid model checkpoints its states there too), so a prompt extending a whole
        earlier prompt resumes at its end.

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
        ok = enable_caching and (self.checkpoints or not num_state_slots)
        self.tails = PromptTails(block_size) if cache_prompt_tails and ok else None
        # Per request: the tail its cache hit ends with (get_computed_blocks until the hit is
        # taken), and the (source, destination) block copies of this step's tail hits.
        self._tail_hits: dict[str, TailHit] = {}
        self._block_copies: list[tuple[int, int]] = []
        if self.checkpoints or self.tails is not None:
            self.pool.on_uncache = self._forget

    def _forget(self, key: BlockHash) -> None:
        self.checkpoints.drop(key)
        if self.tails is not None:
            self.tails.forget(key)

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
    @staticmethod
    def _root(request: Request) -> BlockHash:
        lora = request.lora_request
        return root_block_hash(request.cache_salt, None if lora is None else lora.cache_key)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's block hashes, extended (as far as its tokens allow) to num_blocks."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        B = self.block_size
        parent = hashes[-1] if hashes else self._root(request)
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
        next token), so at most (num_tokens - 1) // block_size blocks hit. With prompt
        tails, a hit may end inside a block: the last full blocks returned are followed by a
        tail (copied into the request's next block by allocate_slots)."""
        self._tail_hits.pop(request.request_id, None)
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
        else:
            n = len(hits)
        if self.tails is not None:
            tail = self._find_tail(request, n, len(hits))
            if tail is not None:
                self._tail_hits[request.request_id] = tail
                return hits[: tail.num_blocks], tail.num_blocks * self.block_size + tail.num_tokens
        hits = hits[:n]
        return hits, len(hits) * self.block_size

    def _find_tail(self, request: Request, n_lo: int, n_hi: int) -> TailHit | None:
        """A cached tail after n in [n_lo, n_hi] cached full blocks ending past n_lo blocks."""
        assert self.tails is not None
        hashes = request.block_hashes
        parents = {n: hashes[n - 1] if n else self._root(request) for n in range(n_lo, n_hi + 1)}

        def usable(key: BlockHash) -> bool:
            return not self.num_state_slots or self.checkpoints.readable(key) is not None

        found = self.tails.find(
            request.all_token_ids,
            parents,
            self.checkpoints.step,
            usable,
            lambda start, end: block_mm_keys(request, start, end),
        )
        if found is None:
            return None
        n, t, key = found
        block = self.pool.lookup_tail(key)
        assert block is not None, "a registered tail without its block"
        return TailHit(n, t, block, key)

    def _register_tail(self, request: Request, p: int) -> tuple[int, int] | None:
        """Cache the prompt's tail ending after p tokens (computed by the step being planned:
        usable from the next one); a hybrid's checkpoint (p, id) of the state there."""
        assert self.tails is not None
        B, rid = self.block_size, request.request_id
        n = p // B
        hashes = self._block_hashes(request, n)
        if len(hashes) < n:
            return None
        parent = hashes[n - 1] if n else self._root(request)
        end = p + self._extra
        toks = request.all_token_ids[n * B : end]
        mm = block_mm_keys(request, n * B, end)
        key = tail_key(parent, toks, mm)
        if self.pool.lookup_tail(key) is not None:
            return None
        out = None
        if self.num_state_slots:
            ckpt = self.checkpoints.save_key(key)
            if ckpt is None:
                return None  # no checkpoint free this step
            out = (p, ckpt)
        self.tails.register(key, parent, toks, p - n * B, mm, self.checkpoints.step)
        self.pool.cache_tail(self.req_to_blocks[rid][n], key)
        return out

    def restore_checkpoint(self, request: Request, num_hit_tokens: int) -> int:
        """The state checkpoint a request starting after num_hit_tokens cached tokens resumes
        from (-1: none, it starts from scratch)."""
        tail = self._tail_hits.pop(request.request_id, None)
        if not self.checkpoints:
            return -1
        if tail is not None:
            return self.checkpoints.restore_key(tail.key)
        return self.checkpoints.restore(request.block_hashes, num_hit_tokens // self.block_size)

    def plan_checkpoints(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """(boundary, checkpoint id) of the states a step computing tokens [start, end) of the
        request saves; only boundaries its known tokens reach (never after a draft). A boundary
        <= start is one the last step passed on drafts accepted since: the workers copy it from
        the states that step kept. With prompt tails, the step computing the end of the
        prompt (less the lookahead tokens a draft's KV there needs) caches its tail."""
        out = self._plan_block_checkpoints(request, start, end)
        if self.tails is not None:  # after the block boundaries: they come first
            p = request.num_prompt_tokens - self._extra
            if p % self.block_size and start < p <= min(end, request.num_tokens):
                tail = self._register_tail(request, p)
                if tail is not None:
                    out = sorted([*out, tail])
        return out

    def _plan_block_checkpoints(
        self, request: Request, start: int, end: int
    ) -> list[tuple[int, int]]:
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

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) KV block copies the workers make before the next step."""
        out, self._block_copies = self._block_copies, []
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
        # A hit ending with a prompt tail: its block is copied into the first new one.
        tail = self._tail_hits.get(rid) if not blocks else None
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        if tail is not None:
            num_computed += tail.num_tokens
        total = num_computed + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(blocks) - len(hits)
        # Cached blocks nobody holds leave the free pool when this request takes them (the
        # tail's block too, until it is copied).
        pinned = [*hits, tail.block] if tail is not None else hits
        num_free = self.pool.num_free_blocks - sum(1 for b in pinned if self.pool.ref_cnt[b] == 0)
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
        if tail is not None:
            self.pool.touch([tail.block])  # not evicted by the take below
        new = self.pool.take(need) if need > 0 else []
        if tail is not None:
            # Copy-on-write: the request writes after the tail into its own copy; the source
            # may be written (or, once released here, reused) only after this step's copies.
            self._block_copies.append((tail.block, new[0]))
            self.pool.give_back([tail.block])
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
        self._tail_hits.pop(request.request_id, None)
        slot = self.req_to_state_slot.pop(request.request_id, None)
        if slot is not None:
            self._free_state_slots.appendleft(slot)

    def usage(self) -> float:
        return self.pool.usage()
