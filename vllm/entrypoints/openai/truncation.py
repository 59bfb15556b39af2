# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""truncate_prompt_tokens, as vLLM applies it to a tokenised prompt."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError


def truncate_prompt(
    ids: list[int], n: int | None, side: str | None, max_model_len: int
) -> list[int]:
    """truncate_prompt_tokens as vLLM: keep the last n tokens (the first with side='right');
    -1 means max_model_len."""
    if n is None:
        return ids
    if n == -1:
        n = max_model_len
    if n > max_model_len:
        raise VLLMValidationError(
            f"truncate_prompt_tokens value ({n}) is greater than max_model_len ({max_model_len})",
            parameter="truncate_prompt_tokens",
        )
    if len(ids) <= n:
        return ids
    return ids[:n] if side == "right" else ids[len(ids) - n :]
