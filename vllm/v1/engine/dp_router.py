# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The data-parallel front end's routing: which replica a request goes to (fewest outstanding
tokens, prefix affinity), and what the front end keeps about each routed request."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

_PREFIX_ENTRIES = 1 << 16  # prefix-block hashes the router remembers (LRU)


# ---- routing ----------------------------------------------------------------------------------
class LoadBalancer:
    """Picks a replica per request: fewest outstanding tokens, with prefix affinity.

    Pure bookkeeping (no I/O), so it is tested on its own. `load[r]` is the outstanding
    tokens of replica r; the caller adds a request's cost when routing it and takes off its
    progress as outputs arrive."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.load = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.block_size = block_size
        self._prefix: collections.OrderedDict[int, int] = collections.OrderedDict()

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        """Chained hashes of the prompt's full blocks (salted: only equal salts match)."""
        out = []
        h = hash(("vllm-dp", cache_salt))
        b = self.block_size
        for i in range(len(token_ids) // b):
            h = hash((h, tuple(token_ids[i * b : (i + 1) * b])))
            out.append(h)
        return out

    def choose(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        live = [r for r, a in enumerate(self.alive) if a]
        if not live:
            raise EngineDeadError("no data-parallel replica is alive")
        least = min(live, key=lambda r: (self.load[r], r))
        hashes = self.block_hashes(token_ids, cache_salt)
        choice = least
        # The longest cached prefix on a live replica: worth going there while the replica is
        # no busier than the least loaded by more than the prefill its cache saves.
        for n in range(len(hashes), 0, -1):
            r = self._prefix.get(hashes[n - 1])
            if r is not None and self.alive[r]:
                if self.load[r] <= self.load[least] + n * self.block_size:
                    choice = r
                break
        for h in hashes:
            self._prefix[h] = choice
            self._prefix.move_to_end(h)
        while len(self._prefix) > _PREFIX_ENTRIES:
            self._prefix.popitem(last=False)
        return choice

    def mark_dead(self, replica: int) -> None:
        self.alive[replica] = False
        self.load[replica] = 0


@dataclasses.dataclass
class _Tracked:
    """A request the front end routed: where it runs and what re-sending it takes."""

    replica: int
    kwargs: dict[str, Any]  # add_processed_request's arguments (to retry it elsewhere)
    cost: int  # outstanding tokens when routed: n x (prompt + allowed output tokens)
    prompt_tokens: int
    done: int = 0  # tokens of progress taken off the replica's load
    delivered: bool = False  # an output reached the caller
    retried: bool = False
    outputs: dict[int, int] = dataclasses.field(default_factory=dict)  # index -> tokens
