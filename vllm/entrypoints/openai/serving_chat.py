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
from vllm.entrypoints.openai.chat_protocol import (
    ChatChoiceLogProbs,
    ChatCompletionLogProb,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    DeltaMessage,
    ToolCall,
    TopLogprob,
)
from vllm.entrypoints.openai.chat_stream import ChoiceStream
from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServingOptions,
    finite,
    prompt_logprobs_json,
    token_text,
)
from vllm.entrypoints.openai.streams import final_usage, stream_events, usage_info
from vllm.entrypoints.openai.tool_calls import (
    named_function,
    parse_tool_calls,
    tool_choice_mode,
)
from vllm.multimodal.chat import resolve_content_format, template_text
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning import ReasoningParser, get_reasoning_parser, reasoning_gate
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream


def chat_logprobs(
    out: CompletionOutput, tokenizer: Any, top_n: int, as_ids: bool = False
) -> ChatChoiceLogProbs | None:
    """The chat logprobs of out's tokens, each with its `top_n` most likely alternatives."""
    if out.logprobs is None:
        return None
    content = []
    for tid, pos in zip(out.token_ids, out.logprobs):
        lp = pos.get(tid)
        text = token_text(lp, tid, tokenizer, as_ids)
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
                        token=(t := token_text(v, k, tokenizer, as_ids)),
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
        options: ServingOptions | None = None,
    ) -> None:
        super().__init__(async_llm, served_model_names, options)
        self.sandbox: ChatTemplateSandbox | None = None
        if self.options.trust_request_chat_template:
            self.sandbox = ChatTemplateSandbox(envs.VLLM_CHAT_TEMPLATE_TIMEOUT_S)
            self.sandbox.start()  # imports in the background, before the first request needs it

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        if req.tools and req.tool_choice == "auto" and not self._auto_tools():
            raise APIError(
                'tool_choice "auto" requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                400,
                "tool_choice",
            )
        engine = self.llm.engine
        # Image parts: image tokens in the text (or placed by an "openai" template), the images
        # as the prompt's multi_modal_data.
        template = req.chat_template or self.options.chat_template or template_text(self.tokenizer)
        conversation, images = req.conversation_and_images(
            engine.image_placeholder,
            engine.model_config.allowed_media_domains,
            resolve_content_format(self.options.chat_template_content_format, template),
        )
        text = await self.render(req, conversation)
        prompt = await self.engine_prompt(req, text, None, req.add_special_tokens)
        if images:
            prompt["multi_modal_data"] = {"image": images}
        reasoner = self._reasoner(req)
        so = params.structured_outputs
        if reasoner is not None and so is not None:
            # The grammar waits for the end of this request's reasoning (the engine would
            # assume the template's defaults; the request's chat_template_kwargs may differ).
            if not engine.vllm_config.structured_outputs_config.enable_in_reasoning:
                so._reasoning_gate = reasoning_gate(reasoner, prompt["prompt_token_ids"])
        return await self._generate(req, raw, [prompt], params)

    def _reasoner(self, req: ChatCompletionRequest) -> ReasoningParser | None:
        """The request's reasoning parser (--reasoning-parser; None without one)."""
        name = self.llm.engine.vllm_config.structured_outputs_config.reasoning_parser
        if not name:
            return None
        return get_reasoning_parser(name)(self.tokenizer, req.chat_template_kwargs)

    async def render(
        self, req: ChatCompletionRequest, conversation: list[dict[str, Any]] | None = None
    ) -> str:
        """The conversation as prompt text: rendered off the event loop, with the request's
        template (sandboxed), else the server's --chat-template, else the tokenizer's; input
        too large to fit is refused by its size first."""
        if conversation is None:
            conversation = req.conversation()
        tok = self.tokenizer
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt are exclusive")
        try:
            kwargs = check_template_kwargs(req.chat_template_kwargs)
        except ValueError as e:
            raise APIError(str(e), 400, "chat_template_kwargs") from None
        # What vLLM hands every template besides the conversation.
        if req.documents is not None:
            kwargs["documents"] = req.documents
        if req.reasoning_effort is not None:
            kwargs["reasoning_effort"] = req.reasoning_effort
        if req.tools:
            kwargs["tools"] = req.tools
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
            return await asyncio.get_running_loop().run_in_executor(
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
        template = self.options.chat_template
        if template is None and not getattr(tok, "chat_template", None):
            raise APIError(
                "the tokenizer has no chat template and the request gives none "
                "(start the server with --chat-template)"
            )
        return await self.llm.in_tokenizer_thread(
            render_trusted,
            tok,
            conversation,
            req.add_generation_prompt,
            req.continue_final_message,
            kwargs,
            template,
        )

    def _auto_tools(self) -> bool:
        return self.options.enable_auto_tool_choice and bool(self.options.tool_call_parser)

    def _tool_mode(self, req: ChatCompletionRequest) -> str:
        """How this request's text becomes tool calls ("none": it does not)."""
        if not req.tools:
            return "none"
        mode = tool_choice_mode(req.tool_choice, True)
        if mode == "auto" and not self._auto_tools():
            return "none"  # tool_choice left unset without auto tools: plain text
        return mode

    def _message(
        self,
        req: ChatCompletionRequest,
        role: str,
        text: str,
        finish_reason: str | None,
        prompt_token_ids: list[int],
        echo: str = "",
    ) -> tuple[ChatMessageOut, str | None]:
        """The message of one choice - its reasoning split off (--reasoning-parser), tool
        calls read out of the rest - and its finish reason ("tool_calls" when the model chose
        to call, as vLLM's)."""
        reasoning: str | None = None
        content: str | None = text
        reasoner = self._reasoner(req)
        if reasoner is not None and not reasoner.ended_at_start(prompt_token_ids):
            reasoning, content = reasoner.split(text)
            content = content or None
        if not req.include_reasoning:
            reasoning = None
        mode = self._tool_mode(req)
        calls: list[dict[str, Any]] = []
        if mode in ("named", "required") or (mode == "auto" and content is not None):
            named = named_function(req.tool_choice) if mode == "named" else None  # type: ignore[arg-type]
            content, calls = parse_tool_calls(
                content or "", mode, named, self.options.tool_call_parser
            )
        if echo:
            content = echo + (content or "")
        msg = ChatMessageOut(
            role=role,
            content=content,
            reasoning_content=reasoning,
            reasoning=reasoning,
            tool_calls=[ToolCall.model_validate(c) for c in calls],
        )
        if (calls and mode == "auto") or (mode == "required" and finish_reason == "stop"):
            finish_reason = "tool_calls"
        return msg, finish_reason

    @staticmethod
    def _role(req: ChatCompletionRequest) -> str:
        # As vLLM: the answer continues the last message's role unless a new turn is prompted.
        return "assistant" if req.add_generation_prompt else req.messages[-1].role

    @staticmethod
    def _echo_text(req: ChatCompletionRequest, role: str) -> str:
        """With echo, the last message's content when the answer continues its role."""
        if not req.echo:
            return ""
        last = req.conversation()[-1]
        return str(last.get("content") or "") if last.get("role") == role else ""

    def _full(
        self, req: ChatCompletionRequest, finals: list[RequestOutput], rid: str, created: int
    ) -> ChatCompletionResponse:
        top_n = req.top_logprobs or 0
        as_ids = self.tokens_as_ids(req)
        role = self._role(req)
        echo = self._echo_text(req, role)
        ro = finals[0]
        choices = []
        for c in ro.outputs:
            message, finish_reason = self._message(
                req, role, c.text, c.finish_reason, list(ro.prompt_token_ids), echo
            )
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=chat_logprobs(c, self.tokenizer, top_n, as_ids),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                )
            )
        res = self._response(
            ChatCompletionResponse,
            rid,
            created,
            choices,
            final_usage(finals, self.options.enable_prompt_tokens_details),
        )
        if req.return_token_ids:
            res.prompt_token_ids = list(ro.prompt_token_ids)
        if req.prompt_logprobs is not None or (req.echo and req.logprobs):
            res.prompt_logprobs = prompt_logprobs_json(ro.prompt_logprobs)
        if req.return_prompt_text:
            res.prompt_text = ro.prompt
        return res

    def _stream(
        self, req: ChatCompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        top_n = req.top_logprobs or 0
        as_ids = self.tokens_as_ids(req)
        prompt_ids = list(streams[0].prompt_token_ids) if streams else []
        reasoner = self._reasoner(req)
        mode = self._tool_mode(req)
        named = named_function(req.tool_choice) if mode == "named" else None  # type: ignore[arg-type]
        choices: dict[int, ChoiceStream] = {}

        def choice(
            idx: int, ro: RequestOutput, c: CompletionOutput
        ) -> ChatCompletionResponseStreamChoice | None:
            state = choices.get(idx)
            if state is None:
                state = choices[idx] = ChoiceStream(
                    mode,
                    named,
                    self.options.tool_call_parser,
                    None if reasoner is None or reasoner.ended_at_start(prompt_ids) else reasoner,
                    req.include_reasoning,
                )
            delta = state.feed(c.text, c.finish_reason is not None)
            logprobs = chat_logprobs(c, self.tokenizer, top_n, as_ids)
            finish_reason = c.finish_reason
            if finish_reason is not None and (
                (mode == "auto" and state.num_calls)
                or (mode == "required" and finish_reason == "stop")
            ):
                finish_reason = "tool_calls"
            if delta is None and finish_reason is None and logprobs is None:
                if not req.return_token_ids:
                    return None  # nothing to say yet (held back, or a think marker)
            return ChatCompletionResponseStreamChoice(
                index=idx,
                delta=delta or DeltaMessage(),
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
            )

        chunk = functools.partial(self._response, ChatCompletionStreamResponse, rid, created)
        role = self._role(req)
        echo = self._echo_text(req, role)
        # As vLLM: first one chunk per choice with the role, then (echo) one per choice with
        # the continued message; prompt ids and text ride on the very first chunk.
        first: list[ChatCompletionStreamResponse] = []
        stream_options = req.stream_options
        continuous = bool(
            stream_options
            and stream_options.include_usage
            and stream_options.continuous_usage_stats
        )
        for i in range(req.n):
            delta = DeltaMessage(role=role, content="")
            first.append(
                chunk(
                    [ChatCompletionResponseStreamChoice(index=i, delta=delta)],
                    usage_info(len(prompt_ids), 0) if continuous else None,
                )
            )
        if first:
            if req.return_token_ids:
                first[0].prompt_token_ids = list(prompt_ids)
            if req.return_prompt_text:
                first[0].prompt_text = streams[0].prompt if streams else None
        if echo:
            for i in range(req.n):
                delta = DeltaMessage(content=echo)
                first.append(
                    chunk([ChatCompletionResponseStreamChoice(index=i, delta=delta)], None)
                )
        return stream_events(
            streams,
            req.n,
            stream_options,
            choice,
            chunk,
            first,
            details=self.options.enable_prompt_tokens_details,
        )
