# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""MultiprocExecutor: one spawned process per worker (TP x PP of them, TP rank inner); the
engine process only schedules.

Each worker process runs a Worker and reads (method, args) messages from its pipe. Every worker
receives every SchedulerOutput in the same order; only TP rank 0 of the last stage answers
execute_model (with the ModelRunnerOutput), the others speak only to report an error. A worker
that raises or dies makes the engine raise a RuntimeError at once and every worker process is
stopped. So does a worker that hangs (stopped, deadlocked): a step, or an idle liveness ping,
that gets no answer within VLLM_PP_STEP_TIMEOUT_S fails the same way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from multiprocessing import connection as mp_connection
from typing import Any

import psutil

from vllm import envs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.abstract import DistributedExecutorBase
from vllm.v1.outputs import ModelRunnerOutput

logger = init_logger(__name__)

# After the engine's end of the pipe closes, a stage gets this long to finish on its own
# (e.g. an orderly shutdown racing the close) before it exits regardless, even when blocked
# in a collective with a peer that is gone.
_ORPHAN_GRACE_S = 2.0
_JOIN_TIMEOUT_S = 5.0
# After a failure every stage is killed: a hung (e.g. stopped) one never acts on SIGTERM.
_FAIL_JOIN_TIMEOUT_S = 1.0
# On a stage's error report, how long to look for a peer that died first (the root cause).
_CAUSE_WAIT_S = 1.0


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mp_context(vllm_config: VllmConfig):
    """spawn (default): every stage starts from a fresh interpreter, never a copy of the engine.
    VLLM_WORKER_MULTIPROC_METHOD=forkserver forks stages from one fresh server process that
    imported torch and the worker once (much faster start-up when engines are created often;
    the server lives until this process exits)."""
    method = envs.VLLM_WORKER_MULTIPROC_METHOD
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Unpickling the config imports transformers' config module: preload it too.
        hf_config_module = type(vllm_config.model_config.hf_config).__module__
        ctx.set_forkserver_preload(["vllm.v1.worker.worker", hf_config_module])
    return ctx


class WorkerFailure(RuntimeError):
    """A pipeline stage raised or died."""


def _stage_main(
    vllm_config: VllmConfig, rank: int, init_method: str, conn, env: dict[str, str]
) -> None:
    """Entry point of a stage process."""
    envs.apply_vllm_env(env)
    from vllm.v1.worker.worker import Worker

    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                inbox.put(conn.recv_bytes())
        except (EOFError, OSError):
            inbox.put(None)
            # The engine is gone: never outlive it (the main thread may be stuck in a collective).
            timer = threading.Timer(_ORPHAN_GRACE_S, os._exit, args=(0,))
            timer.daemon = True
            timer.start()

    threading.Thread(target=read, name="stage-inbox", daemon=True).start()
    worker = None
    is_last = rank == vllm_config.parallel_config.output_rank
    try:
        worker = Worker(vllm_config, rank, init_method)
        worker.init_device()
        worker.load_model()
        conn.send(("ok", None))
        while True:
            msg = inbox.get()
            if msg is None:
                break
            method, args = pickle.loads(msg)
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method != "execute_model" or is_last:
                conn.send(("ok", result))
    except BaseException as e:  # noqa: BLE001 - report anything, then stop this stage
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001 - the engine may be gone already
            pass
        os._exit(1)
    if worker is not None:
        worker.shutdown()


def _join_all(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def _stop_processes(procs: list, conns: list, graceful: bool = True) -> None:
    """Ask every stage to exit (graceful), then terminate / kill whatever is still alive."""
    if graceful:
        bye = pickle.dumps(("shutdown", ()))
        for c in conns:
            try:
                c.send_bytes(bye)
            except Exception:  # noqa: BLE001 - the stage may be dead
                pass
        _join_all(procs, _JOIN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.terminate()
    _join_all(procs, _JOIN_TIMEOUT_S if graceful else _FAIL_JOIN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    _join_all(procs, _JOIN_TIMEOUT_S)
    for c in conns:
        try:
            c.close()
        except OSError:  # the stage's end is gone already
            pass


class MultiprocExecutor(DistributedExecutorBase):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        pc = vllm_config.parallel_config
        self.parallel_config = pc
        self.world_size = pc.world_size  # worker processes
        self.output_rank = pc.output_rank
        self.step_timeout_s = envs.VLLM_PP_STEP_TIMEOUT_S  # read now: a bad value fails at start
        self._failed: str | None = None
        self._inflight = 0
        self._stash: list[deque] = [deque() for _ in range(self.world_size)]
        ctx = _mp_context(vllm_config)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self._procs: list = []
        self._conns: list = []
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_stage_main,
                    args=(vllm_config, rank, init_method, child, envs.vllm_env()),
                    name=(
                        f"VllmWorker-PP{rank}"
                        if pc.tensor_parallel_size == 1
                        else f"VllmWorker-PP{rank // pc.tensor_parallel_size}"
                        f"-TP{rank % pc.tensor_parallel_size}"
                    ),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            for rank in range(self.world_size):
                self._wait_for(rank)  # ready: device, distributed groups, model loaded
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "started %d worker processes (TP %d x PP %d; pids %s)",
            self.world_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            [p.pid for p in self._procs],
        )

    @property
    def max_concurrent_batches(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- transport ----------------------------------------------------------------------
    def _fail(self, msg: str) -> None:
        """Stop every stage at once (a survivor may be stuck in a collective with the failed
        one) and raise."""
        self._failed = msg
        self._inflight = 0
        if self._finalizer.detach() is not None:
            _stop_processes(self._procs, self._conns, graceful=False)
        raise WorkerFailure(msg)

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise WorkerFailure(f"the pipeline stages are stopped after an error: {self._failed}")

    def _died(self, rank: int, then: str = "") -> None:
        proc = self._procs[rank]
        proc.join(timeout=1.0)  # reap it, for its exit code
        self._fail(
            f"{self.parallel_config.describe_rank(rank)} (pid {proc.pid}) died unexpectedly "
            f"(exit code {proc.exitcode}){then}"
        )

    def _silently_dead(self, exclude: int) -> int | None:
        """A stage other than exclude that exited without reporting an error (killed, crashed).

        When one stage dies, its peers soon fail on the broken connection and report that;
        the dead one is the cause worth naming."""
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs) if r != exclude}
        for s in mp_connection.wait(list(sentinels), timeout=_CAUSE_WAIT_S):
            r = sentinels[s]
            try:
                msg = self._conns[r].recv() if self._conns[r].poll() else None
            except (EOFError, OSError):
                msg = None
            if msg is None or msg[0] != "error":
                return r
        return None

    def _take(self, rank: int) -> Any:
        try:
            msg = self._conns[rank].recv()
        except (EOFError, OSError):
            self._died(rank)
        if msg[0] == "error":
            # The stage's traceback goes to the log; the error (and so every client) gets the
            # exception's first line only.
            report = msg[1] or "unknown error"
            who = self.parallel_config.describe_rank(rank)
            logger.error("%s failed:\n%s", who, report)
            first = report.splitlines()[0]
            culprit = self._silently_dead(exclude=rank)
            if culprit is not None:
                self._died(culprit, then=f"; then {who} failed: {first}")
            self._fail(f"{who} failed: {first}")
        return msg[1]

    def _hung(self, waited: float, what: str) -> None:
        stuck = []
        for r, p in enumerate(self._procs):
            try:
                if psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
                    who = self.parallel_config.describe_rank(r)
                    stuck.append(f"{who} (pid {p.pid}) is stopped")
            except psutil.Error:
                pass
        detail = "; ".join(stuck) or "a stage hangs"
        self._fail(
            f"no pipeline stage answered {what} within {waited:.0f} s "
            f"(VLLM_PP_STEP_TIMEOUT_S): {detail}"
        )

    def _stage_cpu_s(self) -> float | None:
        """CPU seconds the stage processes used so far; None when one is stopped or gone."""
        total = 0.0
        for p in self._procs:
            try:
                proc = psutil.Process(p.pid)
                if proc.status() == psutil.STATUS_STOPPED:
                    return None
                t = proc.cpu_times()
            except psutil.Error:
                return None
            total += t.user + t.system
        return total

    def _wait_for(self, rank: int, timeout: float | None = None, what: str = "") -> Any:
        """The next reply of stage rank; raises as soon as any stage reports an error or dies,
        or, with a timeout, when no stage said anything for that long (a hung stage)."""
        if self._stash[rank]:
            return self._stash[rank].popleft()
        target = self._conns[rank]
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        # A step on a loaded machine can outlast the timeout: stages still using CPU are slow,
        # not hung (a stopped, deadlocked or blocked stage uses none).
        cpu_seen = self._stage_cpu_s() if timeout is not None else None
        while True:
            ready = mp_connection.wait([*self._conns, *sentinels], timeout=timeout)
            if not ready:
                assert timeout is not None  # wait() comes back empty only after a timeout
                cpu_now = self._stage_cpu_s()
                if cpu_seen is not None and cpu_now is not None:
                    if cpu_now - cpu_seen >= 0.1 * timeout:
                        logger.warning(
                            "no pipeline stage answered %s within %.0f s "
                            "(VLLM_PP_STEP_TIMEOUT_S), but they are computing: waiting on",
                            what,
                            timeout,
                        )
                        cpu_seen = cpu_now
                        continue
                self._hung(timeout, what)
            for r, c in enumerate(self._conns):
                if c in ready and c is not target:
                    self._stash[r].append(self._take(r))
            if target in ready:
                return self._take(rank)
            for s in ready:
                dead = sentinels.get(s)
                if dead is None:
                    continue
                try:
                    has_words = self._conns[dead].poll()
                except (EOFError, OSError):
                    has_words = False
                if has_words:  # its last words first (an error report)
                    self._stash[dead].append(self._take(dead))
                    continue
                self._died(dead)

    def _send_all(self, method: str, *args: Any, later_stages: tuple | None = None) -> None:
        """Send (method, args) to every worker; later_stages: other args for the workers of
        the stages after the first."""
        self._check_alive()
        data = pickle.dumps((method, args))
        rest = data if later_stages is None else pickle.dumps((method, later_stages))
        first_stage = self.parallel_config.tensor_parallel_size
        for r, c in enumerate(self._conns):
            try:
                c.send_bytes(data if r < first_stage else rest)
            except (BrokenPipeError, OSError) as e:
                self._fail(f"{self.parallel_config.describe_rank(r)} is unreachable: {e}")

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call Worker.method(*args) on every stage and return their results (rank order);
        with a timeout, a stage that does not answer within it counts as hung."""
        if self._inflight:
            raise RuntimeError(f"collective_rpc({method!r}) while {self._inflight} steps in flight")
        self._send_all(method, *args)
        what = f"{method}()"
        return [self._wait_for(r, timeout, what) for r in range(self.world_size)]

    # ---- executor API -------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        # Every stage holds the KV of its own layers for the same block ids.
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        # Pixel values go to the first stage only (the one that runs the encoder).
        rest = scheduler_output.without_pixel_values()
        later = None if rest is scheduler_output else (rest,)
        self._send_all("execute_model", scheduler_output, later_stages=later)
        self._inflight += 1

    def get_output(self) -> ModelRunnerOutput:
        self._check_alive()
        if not self._inflight:
            raise RuntimeError("get_output() with no step in flight")
        out = self._wait_for(self.output_rank, self.step_timeout_s, "a step")
        self._inflight -= 1
        return out

    def check_health(self) -> None:
        """Idle liveness check: every stage process exists and answers a ping (a stopped or
        wedged stage is alive but silent)."""
        self._check_alive()
        for r, p in enumerate(self._procs):
            if not p.is_alive():
                self._fail(f"{self.parallel_config.describe_rank(r)} (pid {p.pid}) is not running")
        if not self._inflight:
            self.collective_rpc("check_health", timeout=self.step_timeout_s)

    def shutdown(self) -> None:
        self._inflight = 0
        self._finalizer()
