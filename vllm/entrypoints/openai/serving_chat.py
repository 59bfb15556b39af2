# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""POST /v1/chat/completions: render the conversation with a chat template, then generate."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm import envs
from vllm.entrypoints.chat_utils import ChatTemplateSandbox, check_template_kwargs, render_trusted
from vllm.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionLogProb,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    DeltaMessage,
    TopLogprob,
)
from vllm.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    final_outputs,
    final_usage,
    finite,
    stream_events,
    token_text,
)
from vllm.outputs import CompletionOutput
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream


def chat_logprobs(out: CompletionOutput, tokenizer: Any, top_n: int) -> ChatChoiceLogProbs | None:
    """The chat logprobs of out's tokens, each with its `top_n` most likely alternatives."""
    if out.logprobs is None:
        return None
    content = []
    for tid, pos in zip(out.token_ids, out.logprobs):
        lp = pos.get(tid)
        text = token_text(lp, tid, tokenizer)
        top = sorted(
            ((k, v) for k, v in pos.items() if v.rank is not None and 1 <= v.rank <= top_n),
            key=lambda kv: kv[1].rank or 0,  # every rank here is set (filtered above)
        )
        content.append(
            ChatCompletionLogProb(
                token=text,
                logprob=finite(lp.logprob) if lp is not None else -9999.0,
                bytes=list(text.encode("utf-8", "replace")),
                top_logprobs=[
                    TopLogprob(
                        token=(t := token_text(v, k, tokenizer)),
                        logprob=finite(v.logprob),
                        bytes=list(t.encode("utf-8", "replace")),
                    )
                    for k, v in top
                ],
            )
        )
    return ChatChoiceLogProbs(content=content)


def _text_bytes(obj: Any) -> int:
    """UTF-8 bytes of every string in a JSON-like value (a conversation, template kwargs)."""
    if isinstance(obj, str):
        return len(obj.encode("utf-8", "surrogatepass"))
    if isinstance(obj, dict):
        return sum(_text_bytes(k) + _text_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(_text_bytes(v) for v in obj)
    return 0


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """bos_token, eos_token, ... as the tokenizer's own rendering passes them to templates."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(v, (str, list))}


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    def __init__(
        self,
        async_llm: AsyncLLM,
        served_model_names: list[str],
        trust_request_chat_template: bool = False,
    ) -> None:
        super().__init__(async_llm, served_model_names)
        self.sandbox: ChatTemplateSandbox | None = None
        if trust_request_chat_template:
            self.sandbox = ChatTemplateSandbox(envs.VLLM_CHAT_TEMPLATE_TIMEOUT_S)
            self.sandbox.start()  # imports in the background, before the first request needs it

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompt = await self._chat_prompt(req)
        return await self._generate(req, raw, [prompt], params)

    async def _chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """Render the conversation (off the event loop) and tokenise it (off the engine
        thread); oversized input is refused by its size before either."""
        conversation = req.conversation()
        tok = self.tokenizer
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt are exclusive")
        try:
            kwargs = check_template_kwargs(req.chat_template_kwargs)
        except ValueError as e:
            raise APIError(str(e), 400, "chat_template_kwargs") from None
        limit = self.llm.max_prompt_bytes
        size = _text_bytes(conversation) + _text_bytes(kwargs)
        if size > limit:
            raise APIError(
                f"the messages have {size} bytes; at most {limit} bytes are accepted "
                f"(max_model_len={self.llm.model_config.max_model_len} tokens)",
                400,
                "messages",
            )
        if req.chat_template is not None:
            if self.sandbox is None:
                raise APIError(
                    "chat_template is not accepted in requests: this server renders only its "
                    "own chat template (start it with --trust-request-chat-template to allow "
                    "request-supplied templates)",
                    400,
                    "chat_template",
                )
            variables = {**_special_tokens(tok), **kwargs}
            text = await asyncio.get_running_loop().run_in_executor(
                None,
                functools.partial(
                    self.sandbox.render,
                    req.chat_template,
                    conversation,
                    req.add_generation_prompt,
                    req.continue_final_message,
                    variables,
                    limit,
                ),
            )
        else:
            if not getattr(tok, "chat_template", None):
                raise APIError("the tokenizer has no chat template and the request gives none")
            text = await self.llm.in_tokenizer_thread(
                render_trusted,
                tok,
                conversation,
                req.add_generation_prompt,
                req.continue_final_message,
                kwargs,
            )
        # The template wrote the special tokens; encoding must not add a BOS a second time.
        ids = await self.llm.in_tokenizer_thread(self.llm.encode, text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    async def _full(
        self, req: ChatCompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> ChatCompletionResponse:
        finals = await final_outputs(streams)
        top_n = req.top_logprobs or 0
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessageOut(role="assistant", content=c.text),
                logprobs=chat_logprobs(c, self.tokenizer, top_n),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in finals[0].outputs
        ]
        return self._response(ChatCompletionResponse, rid, created, choices, final_usage(finals))

    def _stream(
        self, req: ChatCompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        top_n = req.top_logprobs or 0

        def choice(idx: int, c: CompletionOutput) -> ChatCompletionResponseStreamChoice:
            return ChatCompletionResponseStreamChoice(
                index=idx,
                delta=DeltaMessage(content=c.text),
                logprobs=chat_logprobs(c, self.tokenizer, top_n),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )

        # The role comes first, in its own chunk per choice, as OpenAI sends it.
        role = [
            ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content="")
            )
            for i in range(req.n)
        ]
        chunk = functools.partial(self._response, ChatCompletionStreamResponse, rid, created)
        return stream_events(streams, req.n, req.stream_options, choice, chunk, role)
