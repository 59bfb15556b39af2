# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What every OpenAI endpoint shares: the error bodies, the serving base class (model check,
adding engine requests, answering in full or as Server-Sent Events) and the usage counting."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptTokenUsageInfo,
    StreamOptions,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.truncation import truncate_prompt
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream

logger = init_logger(__name__)

ResponseT = TypeVar("ResponseT", bound=BaseModel)


# ---- errors ---------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with an OpenAI-style body and the given HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
    info = ErrorInfo(message=message, type=kind, param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


_MAX_CLIENT_MESSAGE = 300


def client_message(exc: BaseException | str) -> str:
    """What a client is told about an error: the first line of its message, bounded in length.
    Tracebacks (a stage's included) and long dumps stay in the server log."""
    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else type(exc).__name__
    if len(first) > _MAX_CLIENT_MESSAGE:
        first = first[: _MAX_CLIENT_MESSAGE - 3] + "..."
    return first


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A request-schema failure as (one-line message, the first offending field)."""
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        # A model-level check names its field on the error it raised.
        named = getattr((err.get("ctx") or {}).get("error"), "parameter", None)
        if param is None and (loc or named):
            param = loc[0] if loc else named
        msg = str(err.get("msg")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON")
            param = None
        else:
            # A validator's own message may already start with the field's name; an error of
            # no field is the body's as a whole.
            label = where or ("" if named else "body")
            parts.append(f"{label}: {msg}" if label and not msg.startswith(label) else msg)
    return "; ".join(parts) or "invalid request", param


def stream_error(e: Exception) -> dict[str, Any]:
    """The error body sent in-band on a stream whose headers already went out."""
    if isinstance(e, EngineDeadError):
        return error_body(client_message(e), 503)
    logger.error("request failed mid-stream", exc_info=e)
    return error_body(f"internal server error ({type(e).__name__})", 500)


# ---- formatting -----------------------------------------------------------------------------
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
