# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""POST /v1/completions: one engine request per prompt, answered in full or streamed."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
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
    finite,
    prompt_logprobs_json,
    token_text,
)
from vllm.entrypoints.openai.streams import final_usage, stream_events
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.v1.engine.async_llm import RequestStream


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None] | None,
    tokenizer: Any,
    offset: int,
    as_ids: bool = False,
) -> CompletionLogProbs | None:
    """The legacy completions logprobs of token_ids (a position without logprobs - the
    prompt's first token under echo - gets nulls); text offsets count from `offset`."""
    if logprobs is None:
        return None
    res = CompletionLogProbs()
    for tid, pos in zip(token_ids, logprobs):
        lp = pos.get(tid) if pos is not None else None
        text = token_text(lp, tid, tokenizer, as_ids)
        res.tokens.append(text)
        res.token_logprobs.append(finite(lp.logprob) if lp is not None else None)
        res.top_logprobs.append(
            {token_text(v, k, tokenizer, as_ids): finite(v.logprob) for k, v in pos.items()}
            if pos
            else None
        )
        res.text_offset.append(offset)
        offset += len(text)
    return res


def completion_prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    """The prompt field (its shape checked by CompletionRequest) as (text, token ids) pairs."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    return [(None, list(p)) for p in prompt]


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompts = [
            await self.engine_prompt(req, text, ids, req.add_special_tokens)
            for text, ids in completion_prompts(req.prompt)
        ]
        return await self._generate(req, raw, prompts, params)

    def _prompt_text(self, ro: RequestOutput) -> str:
        return ro.prompt if ro.prompt is not None else self.tokenizer.decode(ro.prompt_token_ids)

    def _echoed(
        self, req: CompletionRequest, ro: RequestOutput, c: CompletionOutput, first: bool
    ) -> tuple[str, list[int], list[dict[int, Logprob] | None] | None]:
        """(text, token ids, logprobs) of one choice's output, the prompt in front under echo
        (only the prompt with max_tokens=0); `first`: the choice's first chunk (or all of it)."""
        logprobs: list[dict[int, Logprob] | None] | None = (
            list(c.logprobs) if c.logprobs is not None else None
        )
        text, ids = c.text, list(c.token_ids)
        if req.echo and req.max_tokens == 0:
            text, ids, logprobs = "", [], [] if logprobs is not None else None
        if not (req.echo and first):
            return text, ids, logprobs
        prompt_lps = ro.prompt_logprobs if logprobs is not None else None
        if logprobs is not None:
            logprobs = list(prompt_lps or [None] * len(ro.prompt_token_ids)) + logprobs
        return self._prompt_text(ro) + text, list(ro.prompt_token_ids) + ids, logprobs

    def _full(
        self, req: CompletionRequest, finals: list[RequestOutput], rid: str, created: int
    ) -> CompletionResponse:
        as_ids = self.tokens_as_ids(req)
        choices = []
        for i, ro in enumerate(finals):
            for c in ro.outputs:
                text, ids, lps = self._echoed(req, ro, c, first=True)
                choices.append(
                    CompletionResponseChoice(
                        index=i * req.n + c.index,
                        text=text,
                        logprobs=completion_logprobs(ids, lps, self.tokenizer, 0, as_ids),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None,
                        prompt_token_ids=list(ro.prompt_token_ids)
                        if req.return_token_ids
                        else None,
                        prompt_logprobs=prompt_logprobs_json(ro.prompt_logprobs)
                        if req.prompt_logprobs is not None
                        else None,
                    )
                )
        usage = final_usage(finals, self.options.enable_prompt_tokens_details)
        return self._response(CompletionResponse, rid, created, choices, usage)

    def _stream(
        self, req: CompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # text sent so far per choice: the logprobs' text_offset
        as_ids = self.tokens_as_ids(req)

        def choice(
            idx: int, ro: RequestOutput, c: CompletionOutput
        ) -> CompletionResponseStreamChoice:
            first = idx not in offsets
            text, ids, lps = self._echoed(req, ro, c, first)
            logprobs = completion_logprobs(ids, lps, self.tokenizer, offsets.get(idx, 0), as_ids)
            offsets[idx] = offsets.get(idx, 0) + len(text)
            return CompletionResponseStreamChoice(
                index=idx,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=list(ro.prompt_token_ids)
                if req.return_token_ids and first
                else None,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
            )

        chunk = functools.partial(self._response, CompletionStreamResponse, rid, created)
        return stream_events(
            streams,
            req.n,
            req.stream_options,
            choice,
            chunk,
            details=self.options.enable_prompt_tokens_details,
        )
