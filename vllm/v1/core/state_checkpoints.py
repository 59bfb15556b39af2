# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Checkpoints of a hybrid model's linear-attention states on the KV block grid (pure Python).

A checkpoint id names one copy, on every stage and TP rank, of all of its linear-attention
layers' states (conv + recurrent) after some block boundary of some request. It is keyed by the
hash of the block ending at that boundary, the same chained hash the KV block is cached under,
so a request whose leading blocks hit can resume after the last hit block that has a
checkpoint. The scheduler decides which boundaries each step saves (the workers copy the state
out of the step's forward) and which checkpoint a new request restores.

A checkpoint lives as long as its KV block stays cached (the pool drops it when that block is
evicted) and is itself evicted least recently used when a new one needs its memory. One saved
in a step can be restored from the next step on: stages run steps in order, and within a step
restores happen before the forward that saves.
"""

from __future__ import annotations

from collections import OrderedDict, deque

BlockHash = bytes


class StateCheckpointPool:
    def __init__(self, num_checkpoints: int, block_size: int, mode: str = "align") -> None:
        self.num_checkpoints = num_checkpoints
        self.block_size = block_size
        self.mode = mode
        self._free: deque[int] = deque(range(num_checkpoints))
        # Registered checkpoints in LRU order (oldest first).
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()
        self._hash_of: list[BlockHash | None] = [None] * num_checkpoints
        # Schedule step in which each checkpoint was (last) saved: readable from the next one.
        self._saved_step = [0] * num_checkpoints
        # Checkpoints at prompt tails (save_key): evicted before any at a block boundary.
        self._is_tail = [False] * num_checkpoints
        self.step = 0
        # Saved checkpoints whose block hash is not known yet (it needs lookahead tokens):
        # request id -> {block index: checkpoint id}.
        self._pending: dict[str, dict[int, int]] = {}
        # Per request: tokens of the cached KV run it started after (a shared prefix's end).
        self._junction: dict[str, int] = {}
        # Per request: tokens up to which its boundaries have been considered.
        self._upto: dict[str, int] = {}
        self.num_saved = 0
        self.num_restored = 0

    def __bool__(self) -> bool:
        return self.num_checkpoints > 0

    def new_step(self) -> None:
        self.step += 1

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    # ---- lookup ----------------------------------------------------------------------------
    def readable(self, block_hash: BlockHash) -> int | None:
        ckpt = self._by_hash.get(block_hash)
        if ckpt is None or self._saved_step[ckpt] >= self.step:
            return None
        return ckpt

    def limit_hit(self, request_id: str, hashes: list[BlockHash], num_hit_blocks: int) -> int:
        """The number of leading hit blocks a request can resume after: the last one with a
        readable checkpoint. Remembers the whole run's end as a boundary worth saving."""
        self._junction[request_id] = num_hit_blocks * self.block_size
        for i in range(num_hit_blocks, 0, -1):
            if self.readable(hashes[i - 1]) is not None:
                return i
        return 0

    def restore(self, hashes: list[BlockHash], num_hit_blocks: int) -> int:
        """The checkpoint a request starting after num_hit_blocks cached blocks restores."""
        if num_hit_blocks == 0:
            return -1
        return self.restore_key(hashes[num_hit_blocks - 1])

    def restore_key(self, key: BlockHash) -> int:
        """The checkpoint under a block hash (or a prompt tail's key) a request resumes from."""
        ckpt = self.readable(key)
        assert ckpt is not None, "a hit chosen at a point without a readable checkpoint"
        self._by_hash.move_to_end(key)
        self.num_restored += 1
        return ckpt

    # ---- saving ----------------------------------------------------------------------------
    def boundaries(self, request_id: str, start: int, end: int) -> list[int]:
        """Block boundaries to checkpoint in a step computing from `start` tokens up to `end`
        known ones (never past a draft): those in (start, end], and those the request's last
        step passed on drafts not known then but accepted since (<= start: the workers still
        hold the state after each verified token)."""
        B = self.block_size
        start = min(self._upto.get(request_id, start), start)
        self._upto[request_id] = max(start, end)
        first, last = start // B + 1, end // B
        if last < first:
            return []
        if self.mode == "all":
            return [m * B for m in range(first, last + 1)]
        out = {last * B}
        j = self._junction.get(request_id, 0)
        if start < j <= end:
            out.add(j)
        return sorted(out)

    def save(
        self, request_id: str, boundary: int, hashes: list[BlockHash], is_cached
    ) -> int | None:
        """A checkpoint id for the state after `boundary` tokens (None: the boundary already
        has one, or every checkpoint is unavailable). is_cached(hash): whether its KV block is
        registered; until it is, the checkpoint waits on the request."""
        idx = boundary // self.block_size - 1
        h = hashes[idx] if idx < len(hashes) else None
        if h is not None and h in self._by_hash:
            return None
        ckpt = self._take_for_save()
        if ckpt is None:
            return None
        if h is not None and is_cached(h):
            self._register(ckpt, h)
        else:
            self._pending.setdefault(request_id, {})[idx] = ckpt
        return ckpt

    def _take_for_save(self) -> int | None:
        """A free checkpoint id, marked as saved this step (None: none is available)."""
        ckpt = self._take()
        if ckpt is not None:
            self._saved_step[ckpt] = self.step
            self.num_saved += 1
        return ckpt

    def save_key(self, key: BlockHash) -> int | None:
        """A checkpoint id for the state at the end of a prompt tail (prompt_tails.py),
        registered under its key at once (its KV is registered in the same step)."""
        if key in self._by_hash:
            return None
        ckpt = self._take_for_save()
        if ckpt is None:
            return None
        self._register(ckpt, key)
        self._is_tail[ckpt] = True
        return ckpt

    def on_blocks_cached(self, request_id: str, hashes: list[BlockHash], num_cached: int) -> None:
        """The request's first num_cached blocks are now registered: so are their pending
        checkpoints."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        for idx in [i for i in pending if i < num_cached]:
            ckpt = pending.pop(idx)
            if hashes[idx] in self._by_hash:
                self._free.append(ckpt)
            else:
                self._register(ckpt, hashes[idx])

    def free_request(self, request_id: str) -> None:
        for ckpt in self._pending.pop(request_id, {}).values():
            self._free.append(ckpt)
        self._junction.pop(request_id, None)
        self._upto.pop(request_id, None)

    def drop(self, block_hash: BlockHash) -> None:
        """The KV block under this hash was evicted: its checkpoint cannot be resumed from."""
        ckpt = self._by_hash.pop(block_hash, None)
        if ckpt is not None:
            self._hash_of[ckpt] = None
            self._free.append(ckpt)

    def _register(self, ckpt: int, h: BlockHash) -> None:
        self._by_hash[h] = ckpt
        self._hash_of[ckpt] = h

    def _take(self) -> int | None:
        ckpt = self._take_any()
        if ckpt is not None:
            self._is_tail[ckpt] = False
        return ckpt

    def _take_any(self) -> int | None:
        if self._free:
            return self._free.popleft()
        # Never one saved in this step: two saves of one id in a forward would race. The
        # least recently used prompt tail first (it serves only prompts extending that whole
        # prompt), then the least recently used block boundary.
        for tails_only in (True, False):
            for h, ckpt in self._by_hash.items():
                if self._saved_step[ckpt] < self.step and (self._is_tail[ckpt] or not tails_only):
                    del self._by_hash[h]
                    self._hash_of[ckpt] = None
                    return ckpt
        return None  # all in use by this step or by requests whose blocks are not cached yet
