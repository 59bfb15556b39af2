# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What every OpenAI endpoint shares: the serving base class (model check, adding engine
requests, answering in full or as Server-Sent Events) and the logprob formatting; the error
bodies are in errors.py, the streams and the usage counting in streams.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from vllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm.entrypoints.openai.errors import APIError, client_message
from vllm.entrypoints.openai.protocol import CompletionRequest, PromptLogprob, UsageInfo, random_id
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.streams import (
    _close_all,
    _sse_response,
    _unless_disconnected,
    final_outputs,
)
from vllm.entrypoints.openai.truncation import truncate_prompt
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.outputs import Logprob, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream

logger = init_logger(__name__)

ResponseT = TypeVar("ResponseT", bound=BaseModel)


# ---- formatting -----------------------------------------------------------------------------
def finite(logprob: float) -> float:
    # JSON has no -inf/NaN; a token the sampler ruled out gets a very low finite value instead.
    return logprob if logprob > -9999.0 else -9999.0


def token_text(lp: Logprob | None, tid: int, tokenizer: Any, as_id: bool = False) -> str:
    """A token as logprobs show it: its text, or `token_id:N` (return_tokens_as_token_ids)."""
    if as_id:
        return f"token_id:{tid}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


def prompt_logprobs_json(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[int, PromptLogprob] | None] | None:
    """prompt_logprobs as vLLM answers them: per prompt position (the first is null) token id
    -> {logprob, rank, decoded_token}, -inf clamped to a finite value."""
    if entries is None:
        return None
    return [
        None
        if pos is None
        else {
            t: PromptLogprob(
                logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for t, lp in pos.items()
        }
        for pos in entries
    ]


# ---- the serving base -----------------------------------------------------------------------
@dataclass
class ServingOptions:
    """Server flags the endpoints read (vLLM's spellings in `vllm serve`)."""

    enable_prompt_tokens_details: bool = False
    """usage.prompt_tokens_details.cached_tokens in answers (--enable-prompt-tokens-details)."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens as `token_id:N` unless a request says otherwise."""
    chat_template: str | None = None
    """The chat template (--chat-template), instead of the tokenizer's own."""
    trust_request_chat_template: bool = False
    """Accept chat_template in requests (rendered in a sandbox)."""
    chat_template_content_format: str = "auto"
    """How the template reads message content: "string", "openai" (a list of parts), or
    "auto": read from the template (--chat-template-content-format)."""
    enable_auto_tool_choice: bool = False
    """tool_choice "auto" reads tool calls out of the text (--enable-auto-tool-choice)."""
    tool_call_parser: str | None = None
    """How auto tool calls are written (--tool-call-parser: hermes)."""


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into responses; one
    subclass per endpoint builds the prompts and formats the answer."""

    request_id_prefix = "cmpl"

    def __init__(
        self,
        async_llm: AsyncLLM,
        served_model_names: list[str],
        options: ServingOptions | None = None,
    ) -> None:
        self.llm = async_llm
        self.names = served_model_names
        self.model_name = served_model_names[0]
        self.options = options or ServingOptions()
        self.models = OpenAIServingModels(async_llm, served_model_names)  # + adapters

    def tokens_as_ids(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        flag = req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if flag is None else flag

    async def engine_prompt(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        text: str | None,
        ids: list[int] | None,
        add_special_tokens: bool,
    ) -> dict[str, Any]:
        """The engine prompt of text (tokenised on the tokenizer thread) or of token ids,
        truncated as the request asks, with its cache_salt."""
        if ids is None:
            assert text is not None
            ids = await self.llm.in_tokenizer_thread(
                self.llm.encode, text, add_special_tokens=add_special_tokens
            )
        max_len = self.llm.model_config.max_model_len
        kept = truncate_prompt(ids, req.truncate_prompt_tokens, req.truncation_side, max_len)
        if len(kept) != len(ids):
            text = self.tokenizer.decode(kept)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": kept}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        return prompt

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    def close(self) -> None:
        """Release what the endpoint started (nothing by default)."""

    def _response(
        self,
        cls: type[ResponseT],
        rid: str,
        created: int,
        choices: list[Any],
        usage: UsageInfo | None = None,
    ) -> ResponseT:
        """A response or stream chunk of this endpoint (every one has these five fields)."""
        return cls(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)

    def check_model(self, model: str | None) -> None:
        if not self.models.is_known(model):
            raise APIError(f"The model `{model}` does not exist.", 404, "model")

    def _check_alive(self) -> None:
        if not self.llm.is_running:
            raise APIError(
                f"the engine is not running: {client_message(self.llm.dead_error or 'stopped')}",
                503,
            )

    async def _add_all(
        self, prompts: list[Any], params: SamplingParams, base_id: str, req: Any
    ) -> list[RequestStream]:
        """Add every prompt as its own engine request (req's priority, and the adapter its
        model names); on an error, abort the ones added."""
        self._check_alive()
        lora = self.models.lora_for(req.model)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.llm.add_request(rid, prompt, params, req.priority, lora))
        except BaseException:
            _close_all(streams)
            raise
        return streams

    async def _generate(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        raw: Request,
        prompts: list[Any],
        params: SamplingParams,
    ) -> Response:
        """Run the prompts and answer as a stream or, unless the client leaves, in full."""
        rid = (
            f"{self.request_id_prefix}-{req.request_id}"
            if req.request_id
            else random_id(self.request_id_prefix)
        )
        created = int(time.time())
        if req.use_beam_search:
            from vllm.entrypoints.openai.serving_beam_search import beam_search_outputs

            if any(p.get("multi_modal_data") for p in prompts):
                raise VLLMValidationError(
                    "beam search takes text prompts only (this one has images)",
                    parameter="use_beam_search",
                )

            self._check_alive()
            finals = beam_search_outputs(self, req, prompts, params, rid)
            return await _unless_disconnected(raw, self._answer(req, finals, rid, created))
        streams = await self._add_all(prompts, params, rid, req)
        if req.stream:
            return _sse_response(self._stream(req, streams, rid, created), streams)
        return await _unless_disconnected(
            raw, self._answer(req, final_outputs(streams), rid, created)
        )

    async def _answer(
        self, req: Any, finals: Awaitable[list[RequestOutput]], rid: str, created: int
    ) -> BaseModel:
        return self._full(req, await finals, rid, created)

    def _full(self, req: Any, finals: list[RequestOutput], rid: str, created: int) -> BaseModel:
        """The whole answer from every prompt's finished output."""
        raise NotImplementedError

    def _stream(
        self, req: Any, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        raise NotImplementedError
