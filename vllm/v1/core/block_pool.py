# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""KV block ids with reference counts, the cached prefixes they hold, and their LRU (pure
Python; the prefix caching around it is kv_cache_manager.py's)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

BlockHash = bytes


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
        # Cached prompt tails (prompt_tails.py) whose KV a (partial) block holds.
        self.block_tails: dict[int, list[BlockHash]] = {}
        self._tail_to_block: dict[BlockHash, int] = {}
        # Called with the hash of every block (and the key of every tail) whose cached prefix
        # is forgotten (evicted).
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
                if self.block_hash[b] is not None or b in self.block_tails:
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

    def cache_tail(self, block: int, key: BlockHash) -> None:
        """Register a prompt tail whose KV the first positions of `block` hold (the block's
        owner may still write the positions after it; nobody else writes into the block)."""
        self.block_tails.setdefault(block, []).append(key)
        self._tail_to_block[key] = block

    def lookup_tail(self, key: BlockHash) -> int | None:
        return self._tail_to_block.get(key)

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        forgotten = [] if h is None else [h]
        if h is not None:
            del self._hash_to_block[h]
            self.block_hash[block] = None
        for key in self.block_tails.pop(block, []):
            del self._tail_to_block[key]
            forgotten.append(key)
        if self.on_uncache is not None:
            for key in forgotten:
                self.on_uncache(key)

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
