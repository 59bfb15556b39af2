# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Engine request streams as the endpoints read them: merged as outputs arrive, collected to
their finals, or sent as Server-Sent Events with the usage counting."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from vllm.entrypoints.openai.errors import stream_error
from vllm.entrypoints.openai.protocol import PromptTokenUsageInfo, StreamOptions, UsageInfo
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import RequestStream


def _without_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_without_nulls(v) for v in obj]
    return obj


def sse(obj: Any) -> str:
    """One Server-Sent Event carrying obj as JSON."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump()
        for choice in obj.get("choices", ()):
            if "delta" in choice:  # OpenAI leaves unset delta fields out (nested ones too)
                choice["delta"] = _without_nulls(choice["delta"])
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_info(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> UsageInfo:
    """Usage; with --enable-prompt-tokens-details (cached_tokens given) vLLM adds the prompt
    tokens served from the prefix cache when there are any."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens)
        if cached_tokens
        else None,
    )


# ---- streams --------------------------------------------------------------------------------
async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro: Coroutine[Any, Any, BaseModel]) -> Response:
    """Run coro, cancelling it (which aborts its engine requests) if the client goes away."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        return Response(status_code=499)
    return JSONResponse(work.result().model_dump())


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from all streams as outputs arrive; closes them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, e))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        _close_all(streams)


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream, in stream order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    done = [ro for ro in finals if ro is not None and ro.finished]
    assert len(done) == len(streams)
    return done


def final_usage(finals: list[RequestOutput], details: bool = False) -> UsageInfo:
    return usage_info(
        sum(len(ro.prompt_token_ids) for ro in finals),
        sum(len(c.token_ids) for ro in finals for c in ro.outputs),
        sum(ro.num_cached_tokens for ro in finals) if details else None,
    )


def _close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


def _sse_response(gen: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    # A generator that never starts (the client left before the headers went out) never runs
    # its finally; aborting when it is collected keeps its requests from running on.
    weakref.finalize(gen, _close_all, list(streams))
    return StreamingResponse(gen, media_type="text/event-stream")


async def stream_events(
    streams: list[RequestStream],
    n: int,
    stream_options: StreamOptions | None,
    make_choice: Callable[[int, RequestOutput, CompletionOutput], BaseModel | None],
    make_chunk: Callable[[Sequence[BaseModel], UsageInfo | None], BaseModel],
    first_chunks: Sequence[BaseModel] = (),
    details: bool = False,
) -> AsyncIterator[str]:
    """The SSE body of a streamed answer, shared by both endpoints, laid out as vLLM's.

    Every chunk carries one choice (`i * n + c.index` for completion c of prompt i) with its
    own finish_reason; a choice already sent with its finish_reason is not sent again (n > 1
    outputs repeat finished siblings). With `include_usage` a last choice-less chunk carries
    the usage, and with `continuous_usage_stats` too each chunk carries its choice's usage so
    far. A choice that has nothing to say yet (make_choice gives None) sends no chunk. An error
    after the headers went out is sent in-band; `data: [DONE]` always ends it."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and bool(stream_options and stream_options.continuous_usage_stats)
    prompt_lens = [0] * len(streams)
    cached = [0] * len(streams)
    choice_tokens: dict[int, int] = {}
    done: set[int] = set()
    try:
        for chunk in first_chunks:
            yield sse(chunk)
        async for i, ro in merge_streams(streams):
            prompt_lens[i] = len(ro.prompt_token_ids)
            cached[i] = ro.num_cached_tokens
            for c in ro.outputs:
                idx = i * n + c.index
                if idx in done or (not c.text and not c.token_ids and not c.finish_reason):
                    continue
                if c.finish_reason is not None:
                    done.add(idx)
                choice_tokens[idx] = choice_tokens.get(idx, 0) + len(c.token_ids)
                choice = make_choice(idx, ro, c)
                if choice is None:
                    continue  # nothing to send for these tokens yet
                usage = usage_info(prompt_lens[i], choice_tokens[idx]) if continuous else None
                yield sse(make_chunk([choice], usage))
        if include_usage:
            usage = usage_info(
                sum(prompt_lens), sum(choice_tokens.values()), sum(cached) if details else None
            )
            yield sse(make_chunk([], usage))
    except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
        yield sse(stream_error(e))
    finally:
        _close_all(streams)
    yield "data: [DONE]\n\n"
