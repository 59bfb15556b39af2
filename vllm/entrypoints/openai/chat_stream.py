# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""One streamed chat choice: its deltas split into reasoning, content and tool calls as the
request's tool mode and reasoning parser say."""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.openai.chat_protocol import (
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
)
from vllm.entrypoints.openai.tool_calls import (
    _hermes,
    canonical_json,
    new_call,
    scan_required,
)
from vllm.reasoning import ReasoningParser


class ChoiceStream:
    """One streamed choice: its text so far, split into reasoning (until the end marker) and
    content, and the content read as tool calls as the request's tool mode says. Each call of
    feed() returns what is new (None: nothing yet); what a client accumulates from the deltas
    is the message the same output gets unstreamed."""

    def __init__(
        self,
        mode: str,
        named: str | None,
        tool_call_parser: str | None,
        reasoner: ReasoningParser | None,
        include_reasoning: bool,
    ) -> None:
        self.mode = mode
        self.named = named
        self.hermes = tool_call_parser == "hermes"
        self.reasoner = reasoner  # None: the whole output is content
        self.include_reasoning = include_reasoning
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "sent": argument chars sent}

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        self.text += delta_text
        delta = DeltaMessage()
        content = self.text
        if self.reasoner is not None:
            reasoning, after = self.reasoner.split(self.text)
            new = reasoning[self.reasoning_sent :]
            self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
            if new and self.include_reasoning:
                delta.reasoning_content = delta.reasoning = new
            content = after or ""
        if self.mode == "none":
            self._content(delta, content, len(content))
        elif self.mode == "named":
            self._named(delta, content)
        elif self.mode == "required":
            self._required(delta, content, finished)
        elif self.hermes:
            self._auto(delta, content, finished)
        else:
            self._content(delta, content, len(content))
        if delta == DeltaMessage():
            return None
        return delta

    def _content(self, delta: DeltaMessage, content: str, upto: int) -> None:
        if upto > self.content_sent:
            delta.content = content[self.content_sent : upto]
            self.content_sent = upto

    def _call_delta(self, delta: DeltaMessage, j: int, name: str | None, args: str) -> None:
        """Add call j's news: its header (id, name) the first time, then argument text."""
        if j == len(self.calls):
            call = new_call(name or "", "")
            self.calls.append({"id": call["id"], "name": name, "sent": 0})
            tc = DeltaToolCall(
                index=j,
                id=call["id"],
                type="function",
                function=FunctionCall(name=name, arguments=args),
            )
        else:
            tc = DeltaToolCall(index=j, function=FunctionCall(arguments=args))
        self.calls[j]["sent"] += len(args)
        delta.tool_calls = [*(delta.tool_calls or []), tc]

    def _named(self, delta: DeltaMessage, content: str) -> None:
        # The arguments are the text itself, streamed as it comes (as vLLM).
        if not self.calls and not content:
            return
        sent = self.calls[0]["sent"] if self.calls else 0
        if self.calls and len(content) == sent:
            return
        self._call_delta(delta, 0, self.named, content[sent:])

    def _required(self, delta: DeltaMessage, content: str, finished: bool) -> None:
        for j, c in enumerate(scan_required(content)):
            if c.name is None:
                break
            args = canonical_json(c.params_raw, c.params_done or finished)
            if j < len(self.calls):
                if len(args) > self.calls[j]["sent"]:
                    self._call_delta(delta, j, None, args[self.calls[j]["sent"] :])
            else:
                self._call_delta(delta, j, c.name, args)

    def _auto(self, delta: DeltaMessage, content: str, finished: bool) -> None:
        """hermes: content streams until <tool_call> (a text that may be its beginning is held
        back, and so is whitespace alone); each call is sent whole once its block closes."""
        tag = "<tool_call>"
        start = content.find(tag)
        if start < 0:
            if finished:
                self._content(delta, content, len(content))
                return
            upto = len(content)
            for k in range(1, len(tag)):
                if content.endswith(tag[:k]):
                    upto = len(content) - k
                    break
            if content[:upto].strip():
                self._content(delta, content, upto)
            return
        if content[:start].strip():
            self._content(delta, content, start)
        close = content.rfind("</tool_call>")
        closed = (
            content if finished else content[: close + len("</tool_call>")] if close >= 0 else ""
        )
        _, calls = _hermes(closed) if "<tool_call>" in closed else ("", [])
        for j in range(len(self.calls), len(calls)):
            fn = calls[j]["function"]
            self._call_delta(delta, j, fn["name"], fn["arguments"])
        if finished and not calls:
            self._content(delta, content, len(content))  # no call after all: plain text
