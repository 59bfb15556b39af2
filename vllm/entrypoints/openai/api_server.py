# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLM."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import signal
import socket
import time
import weakref
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    random_id,
)
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from vllm.version import __version__

logger = init_logger(__name__)


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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            parts.append("the request body is not valid JSON")
            param = None
        else:
            # A validator's own message may already start with the field's name.
            parts.append(f"{where}: {msg}" if where and not msg.startswith(where) else msg)
    return "; ".join(parts) or "invalid request", param


# ---- auth -----------------------------------------------------------------------------------
class _APIKeyMiddleware:
    """With --api-key, every /v1 path needs `Authorization: Bearer KEY` - also paths no route
    serves, so an unauthenticated client cannot tell which exist."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and (path == "/v1" or path.startswith("/v1/"))
        ):
            got = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    got = value
                    break
            if not secrets.compare_digest(got, self.expected):
                response = error_response("Unauthorized: missing or wrong API key", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- helpers --------------------------------------------------------------------------------
async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro) -> Any:
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


async def _merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from all streams as outputs arrive."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
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
        for s in streams:
            s.close()


def _sse(obj: Any) -> str:
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump()
        for choice in obj.get("choices", ()):
            if "delta" in choice:  # OpenAI leaves unset delta fields out
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _finite(logprob: float) -> float:
    # JSON has no -inf/NaN; a token the sampler ruled out gets a very low finite value instead.
    return logprob if logprob > -9999.0 else -9999.0


def _token_text(lp: Logprob | None, tid: int, tokenizer) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


def _completion_logprobs(
    out: CompletionOutput, tokenizer, offset: int
) -> CompletionLogProbs | None:
    if out.logprobs is None:
        return None
    res = CompletionLogProbs()
    for tid, pos in zip(out.token_ids, out.logprobs):
        lp = pos.get(tid)
        text = _token_text(lp, tid, tokenizer)
        res.tokens.append(text)
        res.token_logprobs.append(_finite(lp.logprob) if lp is not None else None)
        res.top_logprobs.append(
            {_token_text(v, k, tokenizer): _finite(v.logprob) for k, v in pos.items()}
            if pos
            else None
        )
        res.text_offset.append(offset)
        offset += len(text)
    return res


def _chat_logprobs(out: CompletionOutput, tokenizer, top_n: int) -> ChatChoiceLogProbs | None:
    if out.logprobs is None:
        return None
    content = []
    for tid, pos in zip(out.token_ids, out.logprobs):
        lp = pos.get(tid)
        text = _token_text(lp, tid, tokenizer)
        top = sorted(
            ((k, v) for k, v in pos.items() if v.rank is not None and 1 <= v.rank <= top_n),
            key=lambda kv: kv[1].rank,
        )
        content.append(
            ChatCompletionLogProb(
                token=text,
                logprob=_finite(lp.logprob) if lp is not None else -9999.0,
                bytes=list(text.encode("utf-8", "replace")),
                top_logprobs=[
                    TopLogprob(
                        token=(t := _token_text(v, k, tokenizer)),
                        logprob=_finite(v.logprob),
                        bytes=list(t.encode("utf-8", "replace")),
                    )
                    for k, v in top
                ],
            )
        )
    return ChatChoiceLogProbs(content=content)


# ---- the app --------------------------------------------------------------------------------
class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into responses."""

    def __init__(
        self,
        async_llm: AsyncLLM,
        served_model_names: list[str],
        trust_request_chat_template: bool = False,
    ) -> None:
        self.llm = async_llm
        self.names = served_model_names
        self.model_name = served_model_names[0]
        self.sandbox: ChatTemplateSandbox | None = None
        if trust_request_chat_template:
            self.sandbox = ChatTemplateSandbox(envs.VLLM_CHAT_TEMPLATE_TIMEOUT_S)
            self.sandbox.start()  # imports in the background, before the first request needs it

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")

    def _check_alive(self) -> None:
        if not self.llm.is_running:
            raise APIError(
                f"the engine is not running: {client_message(self.llm.dead_error or 'stopped')}",
                503,
            )

    async def _add_all(self, prompts: list[Any], params, base_id: str) -> list[RequestStream]:
        """Add every prompt as its own engine request; on an error, abort the ones added."""
        self._check_alive()
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.llm.add_request(rid, prompt, params))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompts = _completion_prompts(req.prompt)
        rid = random_id("cmpl")
        streams = await self._add_all(prompts, params, rid)
        created = int(time.time())
        if req.stream:
            gen = self._completion_stream(req, streams, rid, created)
            return _sse_response(gen, streams)
        return await _unless_disconnected(raw, self._completion_full(req, streams, rid, created))

    async def _completion_full(
        self, req: CompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merge_streams(streams):
            finals[i] = out
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, ro in enumerate(finals):
            assert ro is not None and ro.finished
            prompt_tokens += len(ro.prompt_token_ids)
            for c in ro.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(
                    CompletionResponseChoice(
                        index=i * req.n + c.index,
                        text=c.text,
                        logprobs=_completion_logprobs(c, self.tokenizer, 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage(prompt_tokens, completion_tokens),
        )

    async def _completion_stream(
        self, req: CompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        prompt_lens = [0] * len(streams)
        num_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()  # choices already sent with their finish_reason (n > 1)
        try:
            async for i, ro in _merge_streams(streams):
                prompt_lens[i] = len(ro.prompt_token_ids)
                choices = []
                for c in ro.outputs:
                    idx = i * req.n + c.index
                    if idx in done or (not c.text and not c.token_ids and not c.finish_reason):
                        continue
                    if c.finish_reason is not None:
                        done.add(idx)
                    num_tokens[idx] = num_tokens.get(idx, 0) + len(c.token_ids)
                    lps = _completion_logprobs(c, self.tokenizer, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(c.text)
                    choices.append(
                        CompletionResponseStreamChoice(
                            index=idx,
                            text=c.text,
                            logprobs=lps,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if not choices:
                    continue
                chunk = CompletionStreamResponse(
                    id=rid, created=created, model=self.model_name, choices=choices
                )
                if continuous:
                    chunk.usage = _usage(sum(prompt_lens), sum(num_tokens.values()))
                yield _sse(chunk)
            if include_usage:
                yield _sse(
                    CompletionStreamResponse(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=_usage(sum(prompt_lens), sum(num_tokens.values())),
                    )
                )
        except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
            yield _sse(_stream_error(e))
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompt = await self._chat_prompt(req)
        rid = random_id("chatcmpl")
        streams = await self._add_all([prompt], params, rid)
        created = int(time.time())
        if req.stream:
            gen = self._chat_stream(req, streams[0], rid, created)
            return _sse_response(gen, streams)
        return await _unless_disconnected(raw, self._chat_full(req, streams[0], rid, created))

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

    async def _chat_full(
        self, req: ChatCompletionRequest, stream: RequestStream, rid: str, created: int
    ) -> ChatCompletionResponse:
        ro = None
        async for out in stream:
            ro = out
        assert ro is not None and ro.finished
        top_n = req.top_logprobs or 0
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessageOut(role="assistant", content=c.text),
                logprobs=_chat_logprobs(c, self.tokenizer, top_n),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in ro.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in ro.outputs)
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage(len(ro.prompt_token_ids), completion_tokens),
        )

    async def _chat_stream(
        self, req: ChatCompletionRequest, stream: RequestStream, rid: str, created: int
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        top_n = req.top_logprobs or 0
        prompt_tokens = 0
        num_tokens = 0
        done: set[int] = set()  # choices already sent with their finish_reason (n > 1)

        def chunk(choices, usage=None) -> str:
            return _sse(
                ChatCompletionStreamResponse(
                    id=rid, created=created, model=self.model_name, choices=choices, usage=usage
                )
            )

        try:
            # The role comes first, in its own chunk per choice, as OpenAI sends it.
            yield chunk(
                [
                    ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                    for i in range(req.n)
                ]
            )
            async for ro in stream:
                prompt_tokens = len(ro.prompt_token_ids)
                choices = []
                for c in ro.outputs:
                    if c.index in done or (not c.text and not c.token_ids and not c.finish_reason):
                        continue
                    if c.finish_reason is not None:
                        done.add(c.index)
                    num_tokens += len(c.token_ids)
                    choices.append(
                        ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text),
                            logprobs=_chat_logprobs(c, self.tokenizer, top_n),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if choices:
                    usage = _usage(prompt_tokens, num_tokens) if continuous else None
                    yield chunk(choices, usage)
            if include_usage:
                yield chunk([], _usage(prompt_tokens, num_tokens))
        except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
            yield _sse(_stream_error(e))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"


def _close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


def _sse_response(gen: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    # A generator that never starts (the client left before the headers went out) never runs
    # its finally; aborting when it is collected keeps its requests from running on.
    weakref.finalize(gen, _close_all, list(streams))
    return StreamingResponse(gen, media_type="text/event-stream")


def _stream_error(e: Exception) -> dict[str, Any]:
    if isinstance(e, EngineDeadError):
        return error_body(client_message(e), 503)
    logger.error("request failed mid-stream", exc_info=e)
    return error_body(f"internal server error ({type(e).__name__})", 500)


def _text_bytes(obj: Any) -> int:
    """UTF-8 bytes of every string in a JSON-like value (a conversation, template kwargs)."""
    if isinstance(obj, str):
        return len(obj.encode("utf-8", "surrogatepass"))
    if isinstance(obj, dict):
        return sum(_text_bytes(k) + _text_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(_text_bytes(v) for v in obj)
    return 0


def _special_tokens(tokenizer) -> dict[str, Any]:
    """bos_token, eos_token, ... as the tokenizer's own rendering passes them to templates."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(v, (str, list))}


def _completion_prompts(prompt: Any) -> list[Any]:
    """The prompt field (its shape checked by CompletionRequest) as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [{"prompt_token_ids": list(p)} for p in prompt]


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str | list[str],
    api_key: str | None = None,
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """The FastAPI app serving one engine under the given model name(s)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    serving = OpenAIServing(async_llm, names, trust_request_chat_template)
    app = FastAPI(title="vllm", version=__version__)
    app.state.serving = serving
    app.state.async_llm = async_llm
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(client_message(exc), 400)

    @app.exception_handler(TypeError)
    async def _type_error(_: Request, exc: TypeError) -> JSONResponse:
        return error_response(client_message(exc), 400)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(client_message(exc), 503)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises it after this answer, so the traceback reaches the server log.
        return error_response(f"internal server error ({type(exc).__name__})", 500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_llm.is_running else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(async_llm.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> ModelList:
        mc = async_llm.model_config
        return ModelList(
            data=[ModelCard(id=n, root=mc.model, max_model_len=mc.max_model_len) for n in names]
        )

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await serving.completions(request, raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving.chat(request, raw_request)

    app.include_router(v1)
    return app


# ---- running it -----------------------------------------------------------------------------
class _Signals:
    """SIGINT/SIGTERM before uvicorn runs: stop loading and exit 0. uvicorn installs its own
    handlers while serving, and re-raises the signal after its graceful shutdown; then these
    handlers swallow it so the process can shut the engine down and exit 0."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.loading = True
        self.server: Any = None

    def __call__(self, sig: int, frame: Any) -> None:
        self.received = sig
        if self.loading:
            raise KeyboardInterrupt
        if self.server is not None:
            self.server.should_exit = True  # before uvicorn took over the signals

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening address before the model loads: a taken port fails at once."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be an integer in [0, 65535], got {port!r}")
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Build the engine from CLI args, serve until SIGINT/SIGTERM or an engine failure."""
    import uvicorn

    from vllm.engine.arg_utils import EngineArgs

    signals = _Signals()
    signals.install()
    engine_args = EngineArgs.from_cli_args(args)
    api_key = getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY") or None
    server: uvicorn.Server | None = None
    vllm_config = engine_args.create_engine_config()  # bad flags fail before anything else
    sock = bind_socket(args.host, args.port)

    def on_dead(error: BaseException) -> None:
        logger.error("engine died (%s); shutting the server down", error)
        if server is not None:
            server.should_exit = True

    try:
        async_llm = AsyncLLM.from_vllm_config(vllm_config, on_dead=on_dead)
    except KeyboardInterrupt:
        logger.info("interrupted while loading the model; exiting")
        sock.close()
        return 0
    except BaseException:
        sock.close()
        raise
    serving: OpenAIServing | None = None
    try:
        names = async_llm.model_config.served_model_names
        app = build_app(
            async_llm,
            names,
            api_key,
            trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        )
        serving = app.state.serving
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=getattr(args, "uvicorn_log_level", "info"),
            access_log=not getattr(args, "disable_uvicorn_access_log", False),
            timeout_graceful_shutdown=getattr(args, "timeout_graceful_shutdown", None),
            timeout_keep_alive=5,
        )
        server = uvicorn.Server(config)
        signals.server = server
        signals.loading = False
        if signals.received is None and async_llm.is_running:
            port = sock.getsockname()[1]
            logger.info("serving %s on http://%s:%d", names[0], args.host, port)
            server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signals.loading = False
        sock.close()
        if serving is not None:
            serving.close()
        async_llm.shutdown()
        logger.info("engine shut down")
    if async_llm.errored:
        logger.error("exiting after an engine failure: %s", async_llm.dead_error)
        return 1
    return 0
