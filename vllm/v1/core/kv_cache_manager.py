# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Paged KV block accounting (pure Python, no torch).

A request owns a list of block ids covering its computed tokens plus what is scheduled (and the
draft lookahead). Hybrid models also give each request one fixed-size state slot for their
linear-attention layers; blocks and the slot are allocated, preempted and freed together.
"""

from __future__ import annotations

from collections import deque

from vllm.v1.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Free list of KV block ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free)
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        # Freed blocks go to the front in reverse order, so recently used memory is reused first.
        self._free.extendleft(reversed(blocks))

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._free_state_slots: deque[int] = deque(range(num_state_slots))
        self.num_state_slots = num_state_slots
        self.req_to_state_slot: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        """Blocks for num_computed + num_new (+ lookahead) tokens; returns the newly added ids,
        or None (and changes nothing) when the pool cannot cover them."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(blocks)
        needs_slot = self.num_state_slots and request.request_id not in self.req_to_state_slot
        if need > self.pool.num_free_blocks or (needs_slot and not self._free_state_slots):
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if needs_slot:
            self.req_to_state_slot[request.request_id] = self._free_state_slots.popleft()
        new = self.pool.take(need) if need > 0 else []
        blocks.extend(new)
        return new

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.give_back(blocks)
        slot = self.req_to_state_slot.pop(request.request_id, None)
        if slot is not None:
            self._free_state_slots.appendleft(slot)

    def usage(self) -> float:
        return self.pool.usage()
