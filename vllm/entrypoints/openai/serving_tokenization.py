# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""POST /tokenize, POST /detokenize and GET /tokenizer_info, with vLLM's request and response
shapes (/tokenize takes a prompt or, like chat completions, messages)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, model_validator

from vllm.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatMessage
from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.field_rules import refuse_unsupported
from vllm.entrypoints.openai.protocol import NonNegInt64, OpenAIBaseModel
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.exceptions import VLLMValidationError


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        refuse_unsupported(data, cls.model_fields)
        return data


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[NonNegInt64]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):
    """Tokenises exactly as generation does: the same chat rendering, the same tokenizer."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.llm, chat.names, chat.options)
        self.chat = chat

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            if req.tools:
                raise VLLMValidationError("tools are not supported", parameter="tools")
            fields = req.model_dump(exclude={"return_token_strs", "tools"}, exclude_none=True)
            chat_req = ChatCompletionRequest.model_validate(fields)
            text = await self.chat.render(chat_req)
        else:
            text = req.prompt
        ids = await self.llm.in_tokenizer_thread(
            self.llm.encode, text, add_special_tokens=req.add_special_tokens
        )
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.llm.model_config.max_model_len,
            tokens=ids,
            token_strs=strs,
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(
                f"tokens: token id {bad[0]} is out of vocabulary (vocab_size={vocab})",
                400,
                "tokens",
            )
        text = await self.llm.in_tokenizer_thread(self.tokenizer.decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration (its tokenizer_config.json fields), its class and
        the chat template this server renders with."""
        tok = self.tokenizer
        info: dict[str, Any] = {}
        for key, value in (getattr(tok, "init_kwargs", None) or {}).items():
            if key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
                continue  # local paths of this server
            value = getattr(value, "content", value)  # AddedToken -> its text
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                value = str(value)
            info[key] = value
        info["tokenizer_class"] = type(tok).__name__
        template = self.options.chat_template or getattr(tok, "chat_template", None)
        if template:
            info["chat_template"] = template
        return info
