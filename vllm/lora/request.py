# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""LoRARequest: which adapter a request runs with (vLLM's spelling)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path of adapter {self.lora_name!r} must name a PEFT folder, "
                f"got {self.lora_path!r}"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def cache_key(self) -> str:
        """What prefix-cache hashes mix in: blocks of two adapters are never shared."""
        return f"{self.lora_int_id}:{self.lora_name}:{self.lora_path}"


def per_prompt_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None] | None:
    """LLM's lora_request argument as one entry per prompt (None: no adapter anywhere)."""
    if lora_request is None:
        return None
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(loras)} lora_requests")
    for lr in loras:
        if lr is not None and not isinstance(lr, LoRARequest):
            raise TypeError(f"lora_request entries must be LoRARequest or None, got {lr!r}")
    return loras
