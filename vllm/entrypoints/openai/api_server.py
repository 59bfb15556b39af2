# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLM: the app factory,
API-key check, signal handling and socket binding; the endpoints live in serving_*.py."""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm import envs
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm.entrypoints.openai.errors import (
    APIError,
    client_message,
    error_response,
    validation_message,
)
from vllm.entrypoints.openai.protocol import CompletionRequest, ModelCard, ModelList
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import ServingOptions
from vllm.entrypoints.openai.serving_models import (
    OpenAIServingModels,
    add_lora_routes,
    parse_lora_modules,
)
from vllm.entrypoints.openai.serving_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIServingTokenization,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.logger import init_logger
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.version import __version__

logger = init_logger(__name__)


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


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str | list[str],
    api_key: str | None = None,
    options: ServingOptions | None = None,
    enable_server_load_tracking: bool = False,
    enable_tokenizer_info_endpoint: bool = False,
    lora_modules: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app serving one engine under the given model name(s), and the LoRA
    adapters of lora_modules (--lora-modules entries: name=path, or JSON)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    options = options or ServingOptions()
    serving_completion = OpenAIServingCompletion(async_llm, names, options)
    serving_chat = OpenAIServingChat(async_llm, names, options)
    serving_tokenization = OpenAIServingTokenization(serving_chat)
    models = OpenAIServingModels(async_llm, names)
    for name, path, base in parse_lora_modules(lora_modules):
        models.add_static(name, path, base)
    serving_completion.models = serving_chat.models = serving_tokenization.models = models
    app = FastAPI(title="vllm", version=__version__)
    app.state.serving_completion = serving_completion
    app.state.serving_chat = serving_chat
    app.state.async_llm = async_llm
    load = ServerLoad(enable_server_load_tracking)
    app.state.server_load = load
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(client_message(exc), 400, getattr(exc, "parameter", None))

    @app.exception_handler(TypeError)
    async def _type_error(_: Request, exc: TypeError) -> JSONResponse:
        return error_response(client_message(exc), 400, getattr(exc, "parameter", None))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(client_message(exc), 503)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises it after this answer, so the traceback reaches the server log.
        return error_response(f"internal server error ({type(exc).__name__})", 500)

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            return Response(status_code=503)
        # Data parallelism: still serving while one replica is alive; the body names the
        # replicas that died.
        dead = [r for r in async_llm.replica_status() or () if not r["alive"]]
        if dead:
            return JSONResponse({"status": "degraded", "dead_replicas": dead})
        return Response(status_code=200)

    # SageMaker's health check and entry point.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        """SageMaker-style: the body is routed to the first endpoint whose request it is
        (chat completions, then completions), as vLLM does."""
        try:
            body = await raw_request.json()
        except ValueError:
            raise APIError("the request body is not valid JSON") from None
        for model, handler in (
            (ChatCompletionRequest, serving_chat.create_chat_completion),
            (CompletionRequest, serving_completion.create_completion),
        ):
            try:
                request = model.model_validate(body)
            except ValidationError:
                continue
            return await load.tracked(handler(request, raw_request))  # type: ignore[arg-type]
        raise APIError(
            "Cannot find suitable handler for request. Expected one of: "
            "['ChatCompletionRequest', 'CompletionRequest']"
        )

    @app.get("/load")
    async def server_load() -> dict[str, Any]:
        """Requests in flight on the generation endpoints (0 unless the server runs with
        --enable-server-load-tracking); with data parallelism also each replica's status
        and outstanding tokens (`engines`)."""
        out: dict[str, Any] = {"server_load": load.value}
        replicas = async_llm.replica_status()
        if replicas is not None:
            out["engines"] = replicas
        return out

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await serving_tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await serving_tokenization.detokenize(request)

    if enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(serving_tokenization.tokenizer_info())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(async_llm.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        card = models.card(model_id)
        if card is None:
            raise APIError(f"The model `{model_id}` does not exist.", 404, "model")
        return card

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        add_lora_routes(v1, models)

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await load.tracked(serving_completion.create_completion(request, raw_request))

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await load.tracked(serving_chat.create_chat_completion(request, raw_request))

    app.include_router(v1)
    return app


class ServerLoad:
    """Requests in flight on the generation endpoints (vLLM's /load), counted only when
    enabled; a streamed answer counts until its last byte is sent."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.value = 0

    async def tracked(self, call: Awaitable[Response]) -> Response:
        if not self.enabled:
            return await call
        self.value += 1
        try:
            response = await call
        except BaseException:
            self.value -= 1
            raise
        prev = response.background

        async def release() -> None:
            self.value -= 1
            if prev is not None:
                await prev()

        response.background = BackgroundTask(release)
        return response


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
    api_key = getattr(args, "api_key", None) or envs.VLLM_API_KEY
    server: uvicorn.Server | None = None
    vllm_config = engine_args.create_engine_config()  # bad flags fail before anything else
    options = ServingOptions(
        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
        chat_template=load_chat_template(getattr(args, "chat_template", None)),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        chat_template_content_format=getattr(args, "chat_template_content_format", "auto"),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
    )
    if options.enable_auto_tool_choice and not options.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
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
    serving_chat: OpenAIServingChat | None = None
    try:
        names = async_llm.model_config.served_model_names
        app = build_app(
            async_llm,
            names,
            api_key,
            options=options,
            enable_server_load_tracking=getattr(args, "enable_server_load_tracking", False),
            enable_tokenizer_info_endpoint=getattr(args, "enable_tokenizer_info_endpoint", False),
            lora_modules=getattr(args, "lora_modules", None),
        )
        serving_chat = app.state.serving_chat
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
        if serving_chat is not None:
            serving_chat.close()
        async_llm.shutdown()
        logger.info("engine shut down")
    if async_llm.errored:
        logger.error("exiting after an engine failure: %s", async_llm.dead_error)
        return 1
    return 0
