# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Reasoning parsers (`--reasoning-parser`, vLLM's names): split a reasoning model's output into
`reasoning_content` (the thinking between <think> and </think>) and `content` (the answer).

- ``deepseek_r1``: the chat template opens the thinking in the prompt, so the output may lack
  <think>; everything before </think> is reasoning (all of it while </think> has not come).
- ``qwen3``: the same, and ``chat_template_kwargs={"enable_thinking": False}`` turns it off: the
  whole output is content (Qwen3's template then closes an empty think block in the prompt).
- ``deepseek_v3``: DeepSeek-V3.1's hybrid mode: reasoning only with
  ``chat_template_kwargs={"thinking": True}`` (then as deepseek_r1); otherwise all content.

Reasoning also ends in the prompt when the prompt's last think marker is </think> (a template
that closed the think block): then the whole output is content. The engine uses the same
markers to hold structured outputs back until the reasoning ends (vLLM's enable_in_reasoning
False): `reasoning_gate`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3")


class ReasoningParser:
    """The <think> ... </think> split of one request's output."""

    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        vocab = tokenizer.get_vocab()
        self.start_token_id: int | None = vocab.get(self.start_token)
        end_id = vocab.get(self.end_token)
        if end_id is None:
            raise ValueError(
                f"{type(self).__name__}: the tokenizer has no {self.end_token} token "
                "(the reasoning parser needs its think markers as single tokens)"
            )
        self.end_token_id: int = end_id
        self.thinking = self.thinking_enabled(chat_template_kwargs or {})

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any]) -> bool:
        """Whether this request thinks at all (the template kwargs' switch)."""
        return True

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when the last think marker among token_ids is the end marker."""
        for t in reversed(token_ids):
            if t == self.end_token_id:
                return True
            if t == self.start_token_id:
                return False
        return False

    def ended_at_start(self, prompt_token_ids: Sequence[int]) -> bool:
        """The output is all content: thinking is off, or the prompt closed the think block."""
        return not self.thinking or self.is_reasoning_end(prompt_token_ids)

    def split(self, text: str) -> tuple[str, str | None]:
        """(reasoning, content) of an output that started inside the reasoning; content is
        None while the end marker has not come (all of it is reasoning so far)."""
        head, found, tail = text.partition(self.start_token)
        if found:
            text = tail
        reasoning, found, content = text.partition(self.end_token)
        return reasoning, content if found else None


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass


class Qwen3ReasoningParser(ReasoningParser):
    def thinking_enabled(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is not False


class DeepSeekV3ReasoningParser(ReasoningParser):
    def thinking_enabled(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return bool(chat_template_kwargs.get("thinking", False))


_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v3": DeepSeekV3ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; supported: {', '.join(REASONING_PARSERS)}"
        ) from None


def reasoning_gate(
    parser: ReasoningParser, prompt_token_ids: Sequence[int]
) -> tuple[int | None, int, bool]:
    """What the sampling stage needs to hold a grammar back until the reasoning ends:
    (start marker id, end marker id, whether the reasoning has ended before the output)."""
    return parser.start_token_id, parser.end_token_id, parser.ended_at_start(prompt_token_ids)
