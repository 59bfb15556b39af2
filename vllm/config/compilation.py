# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""CompilationConfig: the fixed shapes a step's forward is padded to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CompilationConfig:
    """The shapes the model runner's forwards take (the part of vLLM's compilation_config this
    engine uses)."""

    cudagraph_capture_sizes: list[int] | None = None
    """Token counts a step's flattened batch is padded up to: the smallest size at or above the
    step's token count (a larger step runs unpadded). These are the fixed shapes a captured CUDA
    graph or a compiled forward needs; padded rows are masked out of attention, KV writes,
    linear-attention states and sampling. None or [] (the default): no padding. Sizes above
    max_num_batched_tokens are dropped; enforce_eager turns padding off."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | CompilationConfig | None) -> CompilationConfig:
        if d is None:
            return cls()
        if isinstance(d, CompilationConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"compilation_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - {"cudagraph_capture_sizes"}
        if unknown:
            raise ValueError(
                f"compilation_config has unsupported key(s) {sorted(unknown)}; supported: "
                "['cudagraph_capture_sizes']"
            )
        return cls(**d)

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            return
        if not isinstance(sizes, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes
        ):
            raise ValueError(
                "compilation_config.cudagraph_capture_sizes must be a list of positive "
                f"integers, got {sizes!r}"
            )
        self.cudagraph_capture_sizes = sorted(set(sizes))

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The size a step of num_tokens tokens runs at."""
        for size in self.cudagraph_capture_sizes or ():
            if size >= num_tokens:
                return size
        return num_tokens
