# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Pydantic models of the chat completions endpoint: the request (messages, tools, chat template
options) and its responses and stream chunks. The shared sampling fields are protocol.py's."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from vllm.entrypoints.openai.protocol import (
    Int64,
    NumLogprobs,
    OpenAIBaseModel,
    PromptLogprob,
    UsageInfo,
    _SamplingRequest,
    random_id,
)
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.chat import split_images
from vllm.sampling_params import SamplingParams


class ChatMessage(OpenAIBaseModel):
    # Extra keys (name, tool_calls, ...) are passed on to the chat template.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # ---- vLLM's chat extras implemented here -------------------------------------------------
    echo: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None  # handed to the chat template, as vLLM does
    include_reasoning: bool = True  # false: the reasoning is left out (--reasoning-parser)
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes one call
    return_prompt_text: bool | None = None

    def to_sampling_params(self) -> SamplingParams:
        from vllm.entrypoints.openai.tool_calls import check_tools, tool_grammar

        if self.tools:
            check_tools(self.tools)
        tool_so = tool_grammar(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs:
            prompt_logprobs = self.top_logprobs or 0
        if tool_so is not None and self._structured_outputs() is not None:
            raise VLLMValidationError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format / structured_outputs",
                parameter="tool_choice",
            )
        return self._sampling_params(max_tokens, logprobs, prompt_logprobs, tool_so)

    def conversation(
        self, image_placeholder: str | None = None, allowed_media_domains: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """Messages as plain dicts for a "string" chat template; text parts are joined, image
        parts become image_placeholder (the images: conversation_and_images)."""
        return self.conversation_and_images(image_placeholder, allowed_media_domains)[0]

    def conversation_and_images(
        self,
        image_placeholder: str | None = None,
        allowed_media_domains: list[str] | None = None,
        content_format: str = "string",
    ) -> tuple[list[dict[str, Any]], list[Any]]:
        """(conversation, images in order): see vllm.multimodal.chat.split_images."""
        messages = [m.model_dump(exclude_none=True) for m in self.messages]
        for d, m in zip(messages, self.messages):
            d["content"] = m.content
        return split_images(messages, image_placeholder, allowed_media_domains, content_format)


class FunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatMessageOut(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # With --reasoning-parser: the thinking (vLLM's reasoning_content, and its newer name).
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProb] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # in the first chunk
    prompt_text: str | None = None  # in the first chunk
