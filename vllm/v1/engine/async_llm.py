# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""AsyncLLM: an asyncio front for one LLMEngine. The engine is not thread-safe, so a single
background thread owns it; coroutines talk to that thread through a command queue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.engine_factory import create_engine
from vllm.v1.engine.engine_inputs import EngineInputs
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import PromptType, check_params
from vllm.v1.metrics.reader import Metric

logger = init_logger(__name__)

T = TypeVar("T")


class RequestStream:
    """Outputs of one request, filled by the engine thread and read on the caller's loop.

    Iterating it yields RequestOutputs until the finished one. Outputs that pile up while the
    reader is busy are merged (DELTA: concatenated; otherwise the newest wins)."""

    def __init__(self, owner: AsyncLLM, request_id: str, kind: RequestOutputKind) -> None:
        self.owner = owner
        self.request_id = request_id
        self.kind = kind
        self.loop = asyncio.get_running_loop()
        self.finished = False
        self.prompt: str | None = None  # the prompt as the engine got it (set when added)
        self.prompt_token_ids: list[int] = []
        self._items: deque[RequestOutput | BaseException] = deque()
        self._event = asyncio.Event()

    # Runs on self.loop (scheduled by the engine thread through call_soon_threadsafe).
    def _put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._event.set()

    async def get(self) -> RequestOutput:
        """The next (merged) output; raises the request's error if it failed."""
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._event.clear()
            await self._event.wait()
        out: RequestOutput | None = None
        while self._items:
            item = self._items[0]
            if isinstance(item, BaseException):
                if out is not None:
                    break  # deliver what came before the error first
                self._items.popleft()
                self.finished = True
                raise item
            self._items.popleft()
            out = item if out is None else _merge(out, item, self.kind)
            if out.finished:
                break
        assert out is not None
        self.finished = out.finished
        return out

    def close(self) -> None:
        """Abort the request unless it already finished (safe to call twice)."""
        if not self.finished:
            self.finished = True
            self.owner._abort_nowait(self.request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            # Reached on a cancelled consumer (client disconnect) or an abandoned iterator.
            self.close()


def _merge(a: RequestOutput, b: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """Combine two consecutive outputs of one request into one."""
    if kind != RequestOutputKind.DELTA:
        return b
    by_index = {c.index: c for c in a.outputs}
    merged = []
    for c in b.outputs:
        prev = by_index.pop(c.index, None)
        if prev is None:
            merged.append(c)
            continue
        logprobs = None
        if prev.logprobs is not None or c.logprobs is not None:
            logprobs = (prev.logprobs or []) + (c.logprobs or [])
        merged.append(
            CompletionOutput(
                index=c.index,
                text=prev.text + c.text,
                token_ids=list(prev.token_ids) + list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    merged.extend(by_index.values())
    merged.sort(key=lambda c: c.index)
    return RequestOutput(
        request_id=b.request_id,
        prompt=b.prompt,
        prompt_token_ids=b.prompt_token_ids,
        outputs=merged,
        finished=b.finished,
        prompt_logprobs=b.prompt_logprobs if b.prompt_logprobs is not None else a.prompt_logprobs,
        metrics=b.metrics,
        num_cached_tokens=b.num_cached_tokens,
        error=b.error,
    )


_STOP = object()
HEALTH_CHECK_INTERVAL_S = 1.0
"""How often an idle engine loop checks that its executor (worker processes) is alive."""


class AsyncLLM:
    """Many concurrent `generate` calls sharing one continuously batched LLMEngine."""

    def __init__(
        self, engine: EngineInputs, on_dead: Callable[[BaseException], None] | None = None
    ):
        self.engine = engine
        # A data-parallel front end hands failed requests (their replica died) to this loop,
        # which fails their streams only; one engine's failures fail the whole loop.
        engine.raise_failures = False
        self.on_dead = on_dead
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "is the loop alive" against queueing a command
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._dead: BaseException | None = None
        self._errored = False
        self._flush = False
        # One thread: prompts are tokenised in arrival order, and an HF fast tokenizer may
        # raise 'Already borrowed' when two threads encode with it at once.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vllm-tokenizer"
        )
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(create_engine(engine_args.create_engine_config()), **kwargs)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, **kwargs: Any) -> AsyncLLM:
        return cls(create_engine(vllm_config), **kwargs)

    # ---- state --------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def replica_status(self) -> list[dict[str, Any]] | None:
        """Per data-parallel replica: alive, its error, pid, node, outstanding tokens and
        requests (None for one engine). Read from any thread."""
        status = getattr(self.engine, "replica_status", None)
        return status() if status is not None else None

    @property
    def errored(self) -> bool:
        """True once the engine loop died of an exception (not a requested shutdown)."""
        return self._errored

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_prompt_bytes(self) -> int:
        """Longest prompt text (UTF-8 bytes) the engine accepts before tokenising it."""
        return self.engine.max_prompt_bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenise checked text (blocking: run it through in_tokenizer_thread)."""
        return self.engine.encode(text, add_special_tokens)

    @property
    def registry(self):
        """The engine's prometheus_client registry (thread-safe to read)."""
        return self.engine.registry

    def get_metrics(self) -> list[Metric]:
        return self.engine.get_metrics()

    # ---- requests -----------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Add a request; errors in the prompt or params are raised here, to this caller only."""
        params = check_params(sampling_params)
        self.engine.check_request(params, priority)
        self._check_running()
        if lora_request is not None:  # reads the adapter's folder the first time
            await self.in_tokenizer_thread(self.engine.check_lora, lora_request)
        # Tokenising and checking the prompt run on the tokenizer thread: neither the event
        # loop (other clients, /health) nor the engine thread (every running stream) waits.
        text, ids, salt, mm = await self.in_tokenizer_thread(self.engine.preprocess, prompt)
        stream = RequestStream(self, request_id, params.output_kind)
        stream.prompt, stream.prompt_token_ids = text, list(ids)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(
            ("add", request_id, text, ids, salt, params, priority, stream, fut, mm, lora_request)
        )
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self._abort_nowait(request_id)  # queued after the add, so it finds the request
            raise
        return stream

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn (tokenising, rendering a chat template) on the tokenizer thread."""
        self._check_running()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._tokenizer_pool, functools.partial(fn, *args, **kwargs)
            )
        except RuntimeError as e:
            if self._dead is not None:  # the pool was shut down with the engine
                raise EngineDeadError(f"the engine is not running: {self._dead}") from e
            raise

    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}") from self._dead

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come. Closing or cancelling the consumer aborts
        the request (its KV blocks are freed)."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        async for out in stream:
            yield out

    async def abort(self, request_id: str | list[str]) -> None:
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        try:
            self._send(("abort", ids))
        except EngineDeadError:
            pass  # nothing left to abort

    def _send(self, cmd: tuple) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is not running: {self._dead}") from self._dead
            self._commands.put(cmd)
        self.engine.wakeup()  # a data-parallel front end waiting for its replicas looks now

    # ---- the engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests() or self._flush
                cmds = []
                try:
                    if busy:
                        cmds.append(self._commands.get_nowait())
                    else:
                        cmds.append(self._commands.get(timeout=HEALTH_CHECK_INTERVAL_S))
                    while True:
                        cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if not busy and not cmds:
                    # Idle: notice a dead worker process now, not at the next request.
                    engine.check_health()
                for cmd in cmds:
                    if cmd is _STOP:
                        self._stop(EngineDeadError("the engine was shut down"))
                        return
                    self._handle(cmd)
                if engine.has_unfinished_requests() or self._flush:
                    # An abort leaves finished ids for the workers; one more step tells them and
                    # refreshes the running/waiting gauges even when nothing else runs.
                    self._flush = False
                    self._deliver(engine.step())
                    self._fail(engine.pop_failures())
        except BaseException as e:
            logger.exception("engine loop failed; failing all requests")
            self._errored = True
            self._stop(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"), e)

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, text, ids, salt, params, priority, stream, fut, mm, lora = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_processed_request(
                    rid,
                    text,
                    ids,
                    params,
                    cache_salt=salt,
                    priority=priority,
                    mm_inputs=mm,
                    lora_request=lora,
                )
            except Exception as e:  # noqa: BLE001 - a bad request fails only its caller
                fut.set_exception(e)
                return
            self._streams[rid] = stream
            fut.set_result(None)
        elif cmd[0] == "abort":
            ids = [rid for rid in cmd[1] if rid in self._streams]
            if ids:
                self.engine.abort_request(ids)
                for rid in ids:
                    self._streams.pop(rid, None)
                self._flush = True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        self._post(by_loop)

    def _fail(self, failures: list[tuple[str, BaseException]]) -> None:
        """Fail the streams of requests whose replica died (the engine keeps running)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for rid, error in failures:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, error))
        self._post(by_loop)

    @staticmethod
    def _post(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]]) -> None:
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that loop is closed: nobody is listening any more

    def _stop(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        """Fail every pending request and command, then shut the engine down (this thread)."""
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            self._dead = error
        pending = []
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if isinstance(cmd, tuple) and cmd[0] == "add":
                fut = cmd[8]  # ("add", rid, text, ids, salt, params, priority, stream, fut, mm)
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(error)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream in self._streams.values():
            by_loop.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        self._post(by_loop)
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        if self.on_dead is not None and cause is not None:
            try:
                self.on_dead(error)
            except Exception:
                logger.exception("on_dead callback failed")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread and the executor (and its worker processes)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._dead is None:
                self._commands.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()

    def __del__(self) -> None:
        try:
            if self._thread.is_alive():
                self.shutdown(timeout=5.0)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
