# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Cached prompt tails (pure Python; beyond vLLM, which caches full blocks only).

A prompt that does not end on a block boundary leaves its last tokens in a partial KV block.
Caching that tail lets a later prompt extending the whole prompt (the next turn of a chat:
previous prompt + answer + new message) resume at the prompt's end instead of the last block
boundary before it, so a chat whose turns are shorter than a block still hits.

A tail is identified by its parent (the chained hash of the full blocks before it), its tokens,
the lookahead tokens after it that a draft's KV at its last positions depends on, and the keys
of the images it overlaps; its key hashes all of them. Its KV stays in the partial block of the
request that computed it (that request keeps writing the positions after the tail only); the
block pool keeps the tail's key with the block and forgets it when the block is evicted
(`BlockPool.cache_tail`, `on_uncache`). A request resuming from a tail shares the full blocks
before it and gets a fresh block holding a copy of the tail's block (copy-on-write: nobody
writes into a block that another request or the cache still reads); the workers copy it at the
start of the step, before any forward of that step writes KV. So a tail is usable from the
step after the one that computes it, and a hybrid model also needs the linear-attention state
after the tail: a state checkpoint under the tail's key.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

BlockHash = bytes


@dataclass(frozen=True)
class TailHit:
    num_blocks: int  # full (shared) blocks before the tail
    num_tokens: int  # tokens of the tail, the request's first num_blocks * B + num_tokens
    block: int  # the block holding the tail's KV (copied, never written by the hitting request)
    key: BlockHash


def tail_key(parent: BlockHash, tokens: list[int], mm: bytes) -> BlockHash:
    return hashlib.sha256(b"prompt-tail" + parent + array("q", tokens).tobytes() + mm).digest()


class PromptTails:
    """The registered tails, indexed by parent hash."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # parent -> key -> (tail + lookahead tokens, tail length, image keys)
        self._by_parent: dict[BlockHash, dict[BlockHash, tuple[tuple[int, ...], int, bytes]]] = {}
        self._parent: dict[BlockHash, BlockHash] = {}
        self._step: dict[BlockHash, int] = {}  # the schedule step that computes its KV

    def __len__(self) -> int:
        return len(self._parent)

    def register(
        self, key: BlockHash, parent: BlockHash, tokens: list[int], t: int, mm: bytes, step: int
    ) -> None:
        self._by_parent.setdefault(parent, {})[key] = (tuple(tokens), t, mm)
        self._parent[key] = parent
        self._step[key] = step

    def forget(self, key: BlockHash) -> None:
        """The block holding this tail was evicted (a no-op for any other hash)."""
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        self._step.pop(key, None)
        entries = self._by_parent[parent]
        del entries[key]
        if not entries:
            del self._by_parent[parent]

    def find(
        self,
        tokens: list[int],
        parents: dict[int, BlockHash],
        step: int,
        usable: Callable[[BlockHash], bool],
        mm_keys: Callable[[int, int], bytes],
    ) -> tuple[int, int, BlockHash] | None:
        """The longest registered tail a prompt of `tokens` extends, as (full blocks before
        it, tail tokens, key). parents: full blocks before a candidate -> their chained hash
        (only prefixes whose blocks are all cached). A tail must leave the prompt's last token
        to compute, be computed in an earlier step, and pass usable(key)."""
        B = self.block_size
        best: tuple[int, int, BlockHash] | None = None
        best_end = 0
        for n in sorted(parents, reverse=True):
            start = n * B
            for key, (toks, t, mm) in self._by_parent.get(parents[n], {}).items():
                end = start + t
                if end <= best_end or end > len(tokens) - 1 or start + len(toks) > len(tokens):
                    continue
                if tuple(tokens[start : start + len(toks)]) != toks:
                    continue
                if self._step[key] >= step or mm_keys(start, start + len(toks)) != mm:
                    continue
                if usable(key):
                    best, best_end = (n, t, key), end
        return best
