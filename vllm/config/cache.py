# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""CacheConfig: the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    """Paged KV cache settings."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache; overrides gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use on CUDA."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV blocks of shared prompt prefixes across requests. None (the default): on.
    Hybrid models (linear attention) also keep checkpoints of their linear-attention states on
    the block grid (see mamba_cache_mode), so a hit resumes at a checkpointed block boundary."""
    mamba_cache_mode: str = "align"
    """Hybrid models with prefix caching: at which block boundaries a request's linear-attention
    states are checkpointed. "align": the last boundary each step reaches (the last full block
    of a prompt, of each prefill chunk, each boundary a decode crosses) plus the end of the
    cached run a request started from (where requests sharing a prefix diverge); "all": every
    boundary a step passes; "none": no checkpoints (prefix caching is then off for hybrids)."""
    mamba_cache_prompt_tail: bool = True
    """Hybrid models with prefix caching (beyond vLLM): also cache the end of every prompt that
    does not end on a block boundary - its partial last KV block and the linear-attention
    states there - so a prompt extending a whole earlier one (the next turn of a chat) resumes
    at that prompt's end rather than at the last block boundary before it. A request resuming
    there gets its own copy of the partial block (copy-on-write)."""
    mamba_num_checkpoints: int | None = None
    """Hybrid models: how many linear-attention state checkpoints each stage keeps (least
    recently used evicted first; each holds the states of all of the stage's linear-attention
    layers and is taken from the KV cache budget at start-up). None: 2 x max_num_seqs."""
    num_gpu_blocks: int | None = None
    """Number of KV blocks (derived from the memory budget by the worker)."""
    num_gpu_blocks_override: int | None = None
    """Use this many KV blocks instead of what the memory budget gives (testing, tuning)."""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 1
        ):
            raise ValueError(
                "num_gpu_blocks_override must be a positive integer, got "
                f"{self.num_gpu_blocks_override!r}"
            )
        if self.mamba_cache_mode not in ("align", "all", "none"):
            raise ValueError(
                f"mamba_cache_mode must be 'align', 'all' or 'none', got {self.mamba_cache_mode!r}"
            )
        if self.mamba_num_checkpoints is not None and (
            not isinstance(self.mamba_num_checkpoints, int) or self.mamba_num_checkpoints < 1
        ):
            raise ValueError(
                "mamba_num_checkpoints must be a positive integer, got "
                f"{self.mamba_num_checkpoints!r}"
            )
        if not isinstance(self.mamba_cache_prompt_tail, bool):
            raise ValueError(
                f"mamba_cache_prompt_tail must be a bool, got {self.mamba_cache_prompt_tail!r}"
            )
        if not (self.enable_prefix_caching is None or isinstance(self.enable_prefix_caching, bool)):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
