# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""LoRAConfig: how many adapters the engine holds and how large they may be."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRAConfig:
    """Adapter slots (enable_lora)."""

    max_loras: int = 1
    """Most adapters in one batch (device slots, evicted least recently used)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (least recently used evicted); None: max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        v = self.max_cpu_loras
        if isinstance(v, bool) or not isinstance(v, int) or v < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {v!r}"
            )
