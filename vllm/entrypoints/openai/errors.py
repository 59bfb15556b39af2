# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The OpenAI-style error bodies every endpoint answers with, and the messages they carry."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm.logger import init_logger
from vllm.v1.engine.exceptions import EngineDeadError

logger = init_logger(__name__)


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
