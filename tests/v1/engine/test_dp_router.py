# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The data-parallel router (pure bookkeeping): the replica with the fewest outstanding tokens,
unless a replica that served the same prompt prefix (full blocks, equal cache_salt) is busier
by less than the prefill its cache saves; dead replicas are never chosen."""

from __future__ import annotations

import pytest

from vllm.v1.engine.async_llm import EngineDeadError
from vllm.v1.engine.dp_router import LoadBalancer

BS = 16
PREFIX = list(range(100, 100 + 4 * BS))  # 4 full blocks: 64 tokens a cache hit saves


def test_fewest_outstanding_tokens():
    lb = LoadBalancer(3, BS)
    lb.load[:] = [30, 5, 12]
    assert lb.choose([1, 2, 3]) == 1
    lb.load[:] = [7, 7, 7]
    assert lb.choose([4, 5, 6]) == 0  # a tie goes to the lowest rank


def test_same_prefix_prefers_the_replica_that_served_it():
    lb = LoadBalancer(2, BS)
    lb.load[:] = [0, 10]
    assert lb.choose(PREFIX + [1, 2]) == 0
    # Replica 0 is now busier, but by less than the 64 prompt tokens its cache saves.
    lb.load[:] = [60, 0]
    assert lb.choose(PREFIX + [7, 8, 9]) == 0
    # Busier by more than the cache saves: the least loaded wins.
    lb.load[:] = [100, 0]
    assert lb.choose(PREFIX + [3]) == 1
    # Without a shared full block there is no affinity.
    lb.load[:] = [10, 0]
    assert lb.choose(PREFIX[: BS - 1] + [999] * 40) == 1


def test_prefix_affinity_is_per_cache_salt():
    lb = LoadBalancer(2, BS)
    assert lb.choose(PREFIX, cache_salt="tenant-a") == 0
    lb.load[:] = [20, 0]
    assert lb.choose(PREFIX, cache_salt="tenant-b") == 1
    assert lb.choose(PREFIX, cache_salt="tenant-a") == 0


def test_dead_replicas_are_never_chosen():
    lb = LoadBalancer(2, BS)
    assert lb.choose(PREFIX) == 0
    lb.mark_dead(0)
    lb.load[1] = 1000
    assert lb.choose(PREFIX) == 1  # its prefix's replica is dead: the live one
    lb.mark_dead(1)
    with pytest.raises(EngineDeadError, match="no data-parallel replica is alive"):
        lb.choose([1])
