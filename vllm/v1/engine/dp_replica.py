# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""One data-parallel replica: a whole LLMEngine (scheduler, KV cache, detokeniser, its own
TP x PP workers) in its own process - a spawned process (data_parallel_backend='mp') or a
Ray actor (='ray') - driven by the front end (dp_engine.DPEngine) over one connection.

Protocol (pickled tuples). Front end -> replica: ("add", add_processed_request kwargs),
("abort", ids), ("call", call id, method, args), ("shutdown",). Replica -> front end:
("ready", info), then ("out", request outputs, statistics calls) after every step that
produced something, ("reply", call id, result), and ("dead", message) when its engine fails
(it exits after). A reader thread drains the connection into a queue, so the front end's
sends never wait for a step to end (and the two sides can never block on each other).
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from typing import Any

from vllm import envs
from vllm.config import VllmConfig
from vllm.config.parallel import describe_replica
from vllm.logger import init_logger

logger = init_logger(__name__)

IDLE_CHECK_S = 1.0
"""How often an idle replica checks that its workers are alive (as AsyncLLM does)."""


def pin_cores(cores: list[int] | None) -> None:
    """Bind every thread of this process (and so the threads and processes it starts later)
    to `cores`, and give torch one thread per core unless OMP_NUM_THREADS says otherwise."""
    if not cores:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that just ended
            pass
    if envs.OMP_NUM_THREADS is None:
        import torch

        torch.set_num_threads(len(cores))


def usable_core_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def split_cores(
    num_local: int, available: list[int], want: list[int] | None = None
) -> list[list[int] | None]:
    """Cores of each of num_local replicas sharing a host, from VLLM_DP_CPU_BIND: 'auto' gives
    replica i want[i] cores (default: an equal share of `available`), consecutive and disjoint
    while the host has enough (wrapping round, oversubscribed, when it has not); 'none'
    binds nothing; explicit lists are used as given (one per local replica)."""
    bind = envs.VLLM_DP_CPU_BIND
    if bind == "none":
        return [None] * num_local
    if isinstance(bind, list):
        if len(bind) != num_local:
            raise ValueError(
                f"VLLM_DP_CPU_BIND has {len(bind)} core lists but {num_local} data-parallel "
                "replicas run on this host"
            )
        return [list(c) for c in bind]
    if not available:
        return [None] * num_local
    if want is None:
        want = [max(1, len(available) // num_local)] * num_local
    if sum(want) > len(available):
        logger.warning(
            "%d data-parallel replicas want %d cores but this host has %d: some share cores",
            num_local,
            sum(want),
            len(available),
        )
    out: list[list[int] | None] = []
    start = 0
    for w in want:
        n = min(max(1, w), len(available))
        out.append(sorted({available[(start + j) % len(available)] for j in range(n)}))
        start += n
    return out


class ReplicaLoop:
    """The replica's side of the connection: starts the engine, then steps it while it has
    requests, applying the front end's commands between steps."""

    def __init__(self, conn: Any, vllm_config: VllmConfig) -> None:
        self.conn = conn
        self.vllm_config = vllm_config
        self.rank = vllm_config.parallel_config.data_parallel_rank
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.engine: Any = None

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put(self.conn.recv())
        except (EOFError, OSError):
            self.inbox.put(None)  # the front end is gone

    def _send(self, msg: tuple) -> None:
        self.conn.send(msg)

    def run(self, info: dict[str, Any]) -> None:
        threading.Thread(target=self._read, name="dp-replica-inbox", daemon=True).start()
        from vllm.v1.engine.llm_engine import LLMEngine

        try:
            self.engine = LLMEngine(self.vllm_config)
        except BaseException as e:
            logger.exception("%s failed to start", describe_replica(self.rank))
            self._report_dead(f"failed to start: {type(e).__name__}: {_first_line(e)}")
            return
        relay = self.engine.relay_stats()
        ex = self.engine.executor
        pids = getattr(ex, "worker_pids", None) or [os.getpid()]
        info = {
            **info,
            "pid": os.getpid(),
            "worker_pids": list(pids),
            "worker_placement": getattr(ex, "placement", None),
            "num_blocks": self.engine.scheduler.kv_cache_manager.num_blocks,
            "block_size": self.engine.scheduler.block_size,
            "cores": _affinity(),
        }
        try:
            self._send(("ready", info))
            self._serve(relay)
        except BaseException as e:
            if not isinstance(e, _FrontEndGone):
                logger.exception("%s failed", describe_replica(self.rank))
                self._report_dead(f"{type(e).__name__}: {_first_line(e)}")
        finally:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("%s: engine shutdown failed", describe_replica(self.rank))

    def _report_dead(self, message: str) -> None:
        try:
            self._send(("dead", message))
        except Exception:  # noqa: BLE001 - the front end may be gone too
            pass

    def _serve(self, relay: Any) -> None:
        engine = self.engine
        flush = False
        while True:
            busy = engine.has_unfinished_requests() or flush
            msgs: list[Any] = []
            try:
                msgs.append(
                    self.inbox.get_nowait() if busy else self.inbox.get(timeout=IDLE_CHECK_S)
                )
                while True:
                    msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if not busy and not msgs:
                engine.check_health()  # a dead or hung worker fails the replica now
            for msg in msgs:
                if msg is None:
                    raise _FrontEndGone
                kind = msg[0]
                if kind == "shutdown":
                    return
                if kind == "add":
                    try:
                        engine.add_processed_request(**msg[1])
                    except Exception as e:  # noqa: BLE001 - checked by the front end already
                        self._send(("reject", msg[1]["request_id"], f"{type(e).__name__}: {e}"))
                elif kind == "abort":
                    engine.abort_request(msg[1])
                    flush = True
                elif kind == "call":
                    _, call_id, method, args = msg
                    self._send(("reply", call_id, getattr(self, "_call_" + method)(*args)))
            if engine.has_unfinished_requests() or flush:
                flush = False
                outputs = engine.step()
                stats = relay.drain()
                if outputs or stats:
                    self._send(("out", outputs, stats))
            elif relay.calls:
                self._send(("out", [], relay.drain()))

    # ---- calls ----------------------------------------------------------------------------
    def _call_reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _call_worker_pids(self) -> list[int]:
        return list(getattr(self.engine.executor, "worker_pids", None) or [os.getpid()])


class _FrontEndGone(Exception):
    """The front end closed the connection: stop quietly."""


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


# ---- mp backend -------------------------------------------------------------------------------
def replica_process_main(
    conn: Any, vllm_config: VllmConfig, cores: list[int] | None, env: dict[str, str]
) -> None:
    """Entry point of a replica process (data_parallel_backend='mp')."""
    envs.apply_vllm_env(env)
    pin_cores(cores)
    try:
        ReplicaLoop(conn, vllm_config).run({"node_ip": "127.0.0.1"})
    except BaseException:  # noqa: BLE001 - last resort: never hang the front end
        traceback.print_exc()
    finally:
        try:
            conn.close()
        except OSError:
            pass


# ---- ray backend ------------------------------------------------------------------------------
class RayReplica:
    """Actor body of a replica (data_parallel_backend='ray'): placed by the front end in the
    replica's placement group, it connects back to the front end's listener and serves."""

    def __init__(self, env: dict[str, str]) -> None:
        envs.apply_vllm_env(env)

    def host_info(self) -> dict[str, Any]:
        from vllm.v1.executor import ray_utils

        return {**ray_utils.placement_info(), "cores": usable_core_ids()}

    def run(
        self,
        address: tuple[str, int],
        authkey: bytes,
        vllm_config: VllmConfig,
        cores: list[int] | None,
    ) -> None:
        from multiprocessing.connection import Client

        from vllm.v1.executor import ray_utils

        pin_cores(cores)
        conn = Client(address, authkey=authkey)
        try:
            conn.send(("hello", vllm_config.parallel_config.data_parallel_rank))
            ReplicaLoop(conn, vllm_config).run(ray_utils.placement_info())
        finally:
            try:
                conn.close()
            except OSError:
                pass
