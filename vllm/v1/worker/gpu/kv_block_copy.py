# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Copies of whole KV blocks between block ids, in every attention layer's cache of a stage
(copy-on-write of a cached prompt tail's partial block: v1/core/prompt_tails.py)."""

from __future__ import annotations

import torch


def copy_kv_blocks(
    kv_caches: dict[str, torch.Tensor],
    copies: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
) -> None:
    """Block `dst` := block `src` for each (src, dst), in every cache. A cache holds its
    num_blocks * block_size positions on axis 0 ([positions, ...]: MLA, the sparse indexer)
    or axis 1 ([2, positions, ...]: K and V)."""
    if not copies:
        return
    n = num_blocks * block_size
    for name, cache in kv_caches.items():
        axis = 0 if cache.shape[0] == n else 1
        if cache.shape[axis] != n:
            raise RuntimeError(f"KV cache {name} of shape {tuple(cache.shape)}: no {n} positions")
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=cache.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=cache.device)
        blocks = cache.unflatten(axis, (num_blocks, block_size))  # a view onto the cache
        blocks.index_copy_(axis, dst, blocks.index_select(axis, src))
