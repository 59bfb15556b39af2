# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The rule for request fields: a field vLLM's OpenAI protocol defines is either implemented
here or refused with a 400 naming it (never silently ignored, which would answer wrongly
without an error); a field vLLM does not know is ignored with a logged warning, as vLLM does.

The request models in protocol.py declare what is implemented; REFUSED lists the vLLM fields
that are not, each with the value that means "not used" (which is accepted)."""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger

logger = init_logger(__name__)

_UNUSED: tuple[Any, ...] = (None, [], {}, "")

# vLLM field -> why it is refused. Any value other than None / empty / its default is a 400.
REFUSED: dict[str, str] = {
    # sampling controls not implemented here
    "logits_processors": "logits_processors is not supported",
    "logprob_token_ids": "logprob_token_ids is not supported",
    "watermarking": "watermarking is not supported",
    "repetition_detection": "repetition_detection is not supported",
    "thinking_token_budget": "thinking_token_budget needs a reasoning parser (none is configured)",
    # structured outputs (and vLLM's older guided_* spellings of them)
    "guided_decoding_backend": "guided_decoding_backend is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "structural_tag": "structural_tag is not supported",
    # inputs and transports this server does not have
    "prompt_embeds": "prompt_embeds is not supported",
    "media_io_kwargs": "media_io_kwargs is not supported (no multimodal inputs)",
    "mm_processor_kwargs": "mm_processor_kwargs is not supported (no multimodal inputs)",
    "kv_transfer_params": "kv_transfer_params is not supported (no disaggregated serving)",
    "ec_transfer_params": "ec_transfer_params is not supported (no disaggregated serving)",
    "vllm_xargs": "vllm_xargs is not supported (no request extensions are installed)",
    "routed_experts_prompt_start": "routed_experts_prompt_start is not supported",
    "stream_interval": "stream_interval is not supported (every step is streamed)",
}

# Defaults other than None / empty that also mean "not used".
_DEFAULTS: dict[str, Any] = {"watermarking": False, "routed_experts_prompt_start": 0}


def refuse_unsupported(data: Any, declared: Any = ()) -> None:
    """Raise a 400-worthy error naming the first vLLM field the request uses that is not
    implemented here (a field the request model declares is its own to check)."""
    if not isinstance(data, dict):
        return
    for name, why in REFUSED.items():
        if name not in data or name in declared:
            continue
        value = data[name]
        if any(value is u or value == u for u in _UNUSED) or value == _DEFAULTS.get(name, None):
            continue
        raise VLLMValidationError(f"{why} (got {name}={value!r:.80})", parameter=name)


def warn_unknown(cls_name: str, data: Any, known: set[str]) -> None:
    """Log the fields a request carries that neither this server nor vLLM knows."""
    if not isinstance(data, dict):
        return
    unknown = sorted(k for k in data if k not in known and k not in REFUSED)
    if unknown:
        logger.warning(
            "The following fields were present in the request but ignored: %s (%s)",
            unknown,
            cls_name,
        )
