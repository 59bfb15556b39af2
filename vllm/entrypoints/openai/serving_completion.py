# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""POST /v1/completions: one engine request per prompt, answered in full or streamed."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    final_outputs,
    final_usage,
    finite,
    stream_events,
    token_text,
)
from vllm.outputs import CompletionOutput
from vllm.v1.engine.async_llm import RequestStream


def completion_logprobs(
    out: CompletionOutput, tokenizer: Any, offset: int
) -> CompletionLogProbs | None:
    """The legacy completions logprobs of out's tokens; text offsets count from `offset`."""
    if out.logprobs is None:
        return None
    res = CompletionLogProbs()
    for tid, pos in zip(out.token_ids, out.logprobs):
        lp = pos.get(tid)
        text = token_text(lp, tid, tokenizer)
        res.tokens.append(text)
        res.token_logprobs.append(finite(lp.logprob) if lp is not None else None)
        res.top_logprobs.append(
            {token_text(v, k, tokenizer): finite(v.logprob) for k, v in pos.items()}
            if pos
            else None
        )
        res.text_offset.append(offset)
        offset += len(text)
    return res


def completion_prompts(prompt: Any) -> list[Any]:
    """The prompt field (its shape checked by CompletionRequest) as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [{"prompt_token_ids": list(p)} for p in prompt]


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        return await self._generate(req, raw, completion_prompts(req.prompt), params)

    async def _full(
        self, req: CompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> CompletionResponse:
        finals = await final_outputs(streams)
        choices = [
            CompletionResponseChoice(
                index=i * req.n + c.index,
                text=c.text,
                logprobs=completion_logprobs(c, self.tokenizer, 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, ro in enumerate(finals)
            for c in ro.outputs
        ]
        return self._response(CompletionResponse, rid, created, choices, final_usage(finals))

    def _stream(
        self, req: CompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # text sent so far per choice: the logprobs' text_offset

        def choice(idx: int, c: CompletionOutput) -> CompletionResponseStreamChoice:
            lps = completion_logprobs(c, self.tokenizer, offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + len(c.text)
            return CompletionResponseStreamChoice(
                index=idx,
                text=c.text,
                logprobs=lps,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )

        chunk = functools.partial(self._response, CompletionStreamResponse, rid, created)
        return stream_events(streams, req.n, req.stream_options, choice, chunk)
