# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Chat templates for the server: the model's own template (trusted, rendered by the tokenizer)
and request-supplied ones, rendered in a separate sandbox process that is killed at a deadline.

A jinja2 sandbox stops a template from reaching Python internals, not from running for hours
(three nested `range(100000)` loops) or allocating gigabytes (`"x" * 10**10`); a thread running
one cannot be stopped. So a request's template renders in a child process with a memory cap,
and the parent kills that process when the time limit passes (and starts a fresh one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

# Arguments of apply_chat_template / the renderer: chat_template_kwargs may not set them (a
# request could otherwise swap the template or the output type through the back door).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

_START_TIMEOUT_S = 120.0  # importing the renderer in a fresh interpreter on a loaded machine
_SANDBOX_MEMORY_BYTES = 1 << 30  # address space a render may add to the sandbox's own
_WATCHDOG_S = 0.5


class ChatTemplateError(ValueError):
    """A request's chat template failed, timed out or ran out of memory (a bad request)."""


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs without keys that would override the renderer's own arguments."""
    kwargs = dict(kwargs or {})
    clash = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or k.startswith("_"))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, clash))}")
    return kwargs


_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's contents, else the value itself when it looks
    like a template (has braces or newlines; backslash escapes such as \\n are decoded),
    else an error naming the path that could not be read."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it could not be read: "
                f"{e.strerror or e}"
            ) from None
    # Escapes only: characters beyond Latin-1 pass through unchanged.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def render_trusted(
    tokenizer,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
    chat_template: str | None = None,
) -> str:
    """Render with the server's chat template (--chat-template, else the tokenizer's own;
    server configuration, trusted)."""
    if chat_template is not None:
        template_kwargs = {**template_kwargs, "chat_template": chat_template}
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except Exception as e:  # noqa: BLE001 - the template failing on this input is a bad request
        raise ChatTemplateError(
            f"could not apply the chat template: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(text, str):
        raise ChatTemplateError("the chat template did not render to text")
    return text


def _sandbox_main(conn, parent_pid: int, memory_bytes: int) -> None:
    """The sandbox process: render jobs one at a time until the pipe closes."""
    import resource

    def watchdog() -> None:
        # Orphaned (the server was killed while a template ran): never outlive it.
        while True:
            threading.Event().wait(_WATCHDOG_S)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watchdog, name="sandbox-watchdog", daemon=True).start()
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        import psutil

        used = psutil.Process().memory_info().vms
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = used + memory_bytes
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # no cap available: the time limit still holds
        pass
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            # transformers annotates `-> str` but returns (rendered, generation_indices).
            rendered, _ = render_jinja_template(  # type: ignore[str-unpack]
                conversations=[job["conversation"]],
                chat_template=job["chat_template"],
                add_generation_prompt=job["add_generation_prompt"],
                continue_final_message=job["continue_final_message"],
                **job["variables"],
            )
            text = rendered[0]
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > job["max_bytes"]:
                raise ValueError(
                    f"the rendered prompt has {size} bytes; at most {job['max_bytes']} are accepted"
                )
            reply = ("ok", text)
        except MemoryError:
            reply = ("error", f"MemoryError: rendering needed more than {memory_bytes >> 20} MiB")
        except Exception as e:  # noqa: BLE001 - reported to the request, the sandbox lives on
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


class ChatTemplateSandbox:
    """Renders request-supplied chat templates in a child process, one at a time, each within
    timeout_s (the process is killed past it) and a memory cap."""

    def __init__(self, timeout_s: float, memory_bytes: int = _SANDBOX_MEMORY_BYTES) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._ctx = mp.get_context("spawn")
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False
        self.num_killed = 0

    def start(self) -> None:
        """Start the sandbox process now (it imports the renderer in the background)."""
        with self._lock:
            if self._proc is None:
                self._spawn()

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_sandbox_main,
            args=(child, os.getpid(), self.memory_bytes),
            name="VllmChatTemplateSandbox",
            daemon=True,
        )
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False

    def _ensure_ready(self) -> Connection:
        """The connection to a sandbox that is up and has said it is ready."""
        if self._proc is None or not self._proc.is_alive():
            self._kill()
            self._spawn()
        conn = self._conn
        assert conn is not None  # _spawn() set it
        if self._ready:
            return conn
        if not conn.poll(_START_TIMEOUT_S):
            self._kill()
            raise RuntimeError("the chat template sandbox did not start")
        try:
            conn.recv()
        except (EOFError, OSError) as e:
            self._kill()
            raise RuntimeError("the chat template sandbox exited while starting") from e
        self._ready = True
        return conn

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._ready = False
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=10)
        if conn is not None:
            conn.close()

    def render(
        self,
        chat_template: str,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: dict[str, Any],
        max_bytes: int,
    ) -> str:
        """Render (blocking: call it from a worker thread). Raises ChatTemplateError when the
        template fails, exceeds the time limit or the memory cap, or renders too much text."""
        job = {
            "chat_template": chat_template,
            "conversation": conversation,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "variables": variables,
            "max_bytes": max_bytes,
        }
        with self._lock:
            conn = self._ensure_ready()
            try:
                conn.send(job)
                done = conn.poll(self.timeout_s)
                reply = conn.recv() if done else None
            except (EOFError, OSError, BrokenPipeError):
                self._kill()
                raise ChatTemplateError(
                    "could not apply the chat template: the sandbox process died"
                ) from None
            if reply is None:
                self._kill()
                self.num_killed += 1
                logger.warning(
                    "a request's chat template ran past %.1f s; its sandbox was killed",
                    self.timeout_s,
                )
                raise ChatTemplateError(
                    f"the chat template did not finish rendering within {self.timeout_s:g} s"
                )
        status, value = reply
        if status != "ok":
            raise ChatTemplateError(f"could not apply the chat template: {value}")
        return value

    def close(self) -> None:
        with self._lock:
            self._kill()
