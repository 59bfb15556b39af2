# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm serve [MODEL] ...`: the OpenAI-compatible server, flags spelled as vLLM spells them."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from vllm.engine.arg_utils import EngineArgs

_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {value!r}")
    return port


def _make_error(prog: str):
    def error(message: str) -> NoReturn:
        # argparse would print the whole usage first; a bad flag deserves one line.
        print(f"{prog}: error: {_one_line(message)}", file=sys.stderr)
        sys.exit(2)

    return error


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    parser.error = _make_error(parser.prog)
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Local HF-format model folder (default: the bundled default model)",
    )
    parser.add_argument("--model", type=str, default=None, help="Same as MODEL")
    parser.add_argument("--host", type=str, default="0.0.0.0", help="Address to bind")
    parser.add_argument("--port", type=_port, default=8000, help="Port to bind (0: any free one)")
    parser.add_argument(
        "--served-model-name",
        type=str,
        nargs="+",
        default=None,
        help="Name(s) clients use in `model`; the first is reported (default: the model path)",
    )
    parser.add_argument(
        "--lora-modules",
        type=str,
        nargs="+",
        default=None,
        help="LoRA adapters to serve (with --enable-lora), each `name=path` or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request picks one by `model`',
    )
    parser.add_argument(
        "--api-key",
        type=str,
        default=None,
        help="Require `Authorization: Bearer KEY` on /v1/* (also read from VLLM_API_KEY)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        type=str,
        default="info",
        choices=_LOG_LEVELS,
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept a chat_template in requests (rendered in a sandbox process, time-limited "
        "by VLLM_CHAT_TEMPLATE_TIMEOUT_S); by default such requests get 400",
    )
    parser.add_argument(
        "--chat-template",
        type=str,
        default=None,
        help="The chat template to render conversations with, instead of the tokenizer's: "
        "a file, or the template itself",
    )
    parser.add_argument(
        "--chat-template-content-format",
        type=str,
        default="auto",
        choices=["auto", "string", "openai"],
        help="How the chat template reads message content: 'string' (image parts become "
        "the model's image placeholder in the text), 'openai' (the template loops over the "
        "content parts and places the image tokens itself), 'auto' (read from the template)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": read tool calls out of the model\'s text with --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        type=str,
        default=None,
        choices=["hermes"],
        help="How the model writes tool calls (hermes: <tool_call>{json}</tool_call>)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Report usage.prompt_tokens_details.cached_tokens (prompt tokens from the prefix "
        "cache)",
    )
    parser.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="Count requests in flight on the generation endpoints, served at GET /load",
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info (the tokenizer's configuration and chat template)",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Show logprob tokens as 'token_id:N' unless a request says otherwise",
    )
    parser.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=None,
        help="Seconds in-flight requests get to finish after SIGINT/SIGTERM (default: no limit)",
    )
    EngineArgs.add_cli_args(parser)
    # A server logs its periodic stats unless told not to, as vLLM's does; offline engines
    # (LLM, EngineArgs) keep them off by default.
    parser.set_defaults(disable_log_stats=False)
    parser.set_defaults(dispatch=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_tag and args.model and args.model_tag != args.model:
        print(
            f"vllm serve: error: MODEL {args.model_tag!r} and --model {args.model!r} differ",
            file=sys.stderr,
        )
        return 2
    args.model = args.model_tag or args.model
    from vllm.entrypoints.openai.api_server import run_server

    try:
        return run_server(args)
    except (ValueError, TypeError, OSError) as e:
        # Bad configuration: one line, no traceback.
        print(f"vllm serve: error: {_one_line(e)}", file=sys.stderr)
        return 1
