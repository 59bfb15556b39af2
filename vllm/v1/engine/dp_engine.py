# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DPEngine: the front end of data parallelism - N engine replicas (dp_replica.py), each a
whole LLMEngine with its own scheduler, KV cache and TP x PP workers, behind one LLMEngine-like
interface, so `LLM` and `AsyncLLM` (and so `vllm serve`) drive it unchanged.

- Inputs are tokenised and checked here (EngineInputs), and unseeded requests get their seeds
  here, drawn in request order exactly as one engine would: outputs do not depend on the
  number of replicas or on which replica ran a request.
- Routing (LoadBalancer): each request goes to the live replica with the fewest outstanding
  tokens (prompt tokens not yet answered plus output tokens still allowed, over its queued and
  running requests), unless a replica that served the same prompt prefix (full KV blocks,
  chained hashes salted by cache_salt) is within the tokens its cache would save.
- Statistics: every replica relays its step statistics; they are recorded here under the
  replica's `engine` label (vLLM's), and get_metrics() adds their sum over replicas.
- Failure: a replica that dies (its process or actor, or its engine failing on a dead worker)
  is named in the log; each of its requests that has not delivered any output yet is sent
  once to another live replica, the others fail with ReplicaDeadError naming the replica;
  the other replicas keep serving. Only when no replica is left does the engine fail.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from multiprocessing import connection as mp_connection
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalInputs
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.dp_launch import Replica, ReplicaLauncher, _stop_replicas
from vllm.v1.engine.dp_router import LoadBalancer, _Tracked
from vllm.v1.engine.engine_inputs import EngineInputs
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import check_params
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.reader import Metric, get_metrics_snapshot, sum_over_engines
from vllm.v1.metrics.stats import spec_proposer_names

logger = init_logger(__name__)

_WAIT_S = 1.0  # longest a step waits for a replica (then the caller's loop checks in)


class ReplicaDeadError(EngineDeadError):
    """The data-parallel replica a request ran on died; other replicas keep serving."""


class DPEngine(EngineInputs, ReplicaLauncher):
    """N replica engines behind one LLMEngine-like interface (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._init_inputs(vllm_config)
        pc = vllm_config.parallel_config
        mc = self.model_config
        assert mc.max_model_len is not None
        self.num_replicas = pc.data_parallel_size
        k = vllm_config.num_speculative_tokens
        self.prom = PrometheusStatLogger(
            mc.served_model_names[0],
            k,
            max_model_len=mc.max_model_len,
            cache_config_info={
                f.name: str(getattr(vllm_config.cache_config, f.name))
                for f in dataclasses.fields(vllm_config.cache_config)
            },
            engine_indexes=list(range(self.num_replicas)),
            spec_proposers=spec_proposer_names(vllm_config.speculative_config),
        )
        self.stat_loggers: list[LoggingStatLogger] | None = None
        if not vllm_config.disable_log_stats:
            self.stat_loggers = [
                LoggingStatLogger(k, prefix=f"Engine {i:03d}: ") for i in range(self.num_replicas)
            ]
        self.raise_failures = True  # LLM: step() raises; AsyncLLM reads pop_failures()
        self._requests: dict[str, _Tracked] = {}
        self._pending: list[RequestOutput] = []
        self._failures: list[tuple[str, BaseException]] = []
        self._replies: dict[int, dict[int, Any]] = {}
        self._call_id = 0
        self._closed = False
        self._wake_r, self._wake_w = mp_connection.Pipe(duplex=False)
        self.replicas = [Replica(i) for i in range(self.num_replicas)]
        self._state: dict[str, Any] = {"replicas": self.replicas, "started_ray": False}
        self._finalizer = weakref.finalize(self, _stop_replicas, self._state)
        self.backend = pc.data_parallel_backend or "mp"
        try:
            if self.backend == "ray":
                self._start_ray()
            else:
                self._start_mp()
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        infos = [r.info for r in self.replicas]
        self.num_blocks = min(i["num_blocks"] for i in infos)
        self.block_size = infos[0]["block_size"]
        vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        self.balancer = LoadBalancer(self.num_replicas, self.block_size)
        for r in self.replicas:
            logger.info(
                "%s ready: node %s, pid %s, cores %s, workers %s, %d KV blocks",
                r.name,
                r.info.get("node_ip"),
                r.info.get("pid"),
                r.info.get("cores"),
                r.info.get("worker_pids"),
                r.info["num_blocks"],
            )

    # ---- requests ---------------------------------------------------------------------------
    def _check_fits(self, num_prompt_tokens: int) -> None:
        need = -(-(num_prompt_tokens + 1) // self.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"the prompt of {num_prompt_tokens} tokens can never fit in the KV cache "
                f"({self.num_blocks} blocks of {self.block_size} tokens)"
            )

    def add_processed_request(
        self,
        request_id: str,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        mm_inputs: MultiModalInputs | None = None,
        seeds: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """seeds: ignored (the front end draws an unseeded request's seeds itself)."""
        params = check_params(params)
        self.check_request(params, priority)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_alive()
        kwargs = {
            "request_id": request_id,
            "text": text,
            "prompt_token_ids": list(prompt_token_ids),
            "params": params,
            "arrival_time": arrival_time if arrival_time is not None else time.time(),
            "cache_salt": cache_salt,
            "priority": priority,
            "mm_inputs": mm_inputs,
            "lora_request": self.inputs.lora_checker.checked(lora_request),
            # Drawn here, in request order, as one engine draws them.
            "seeds": self.draw_seeds(params.n) if params.seed is None else None,
        }
        max_len = self.model_config.max_model_len
        assert max_len is not None
        n_prompt = len(prompt_token_ids)
        max_out = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
        cost = params.n * (n_prompt + max(0, max_out))
        # Prefixes are shared per adapter (as the replicas' prefix caches key them).
        route_salt = (
            cache_salt if lora_request is None else f"{cache_salt}|lora:{lora_request.lora_int_id}"
        )
        replica = self.balancer.choose(list(prompt_token_ids), route_salt)
        self._requests[request_id] = _Tracked(replica, kwargs, cost, n_prompt)
        self.balancer.load[replica] += cost
        self._send(replica, ("add", kwargs))

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            t = self._requests.pop(rid, None)
            if t is None:
                continue
            self._release(t)
            by_replica.setdefault(t.replica, []).append(rid)
        for replica, ids in by_replica.items():
            if self.replicas[replica].alive:
                self._send(replica, ("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending or self._failures)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def reset_prefix_cache(self) -> bool:
        results = self._call_all("reset_prefix_cache")
        return all(results)

    def worker_pids(self) -> dict[int, list[int]]:
        """Per live replica, the pids of its workers (its own pid when it holds its worker)."""
        live = [r.rank for r in self.replicas if r.alive]
        return dict(zip(live, self._call_all("worker_pids")))

    # ---- stepping ---------------------------------------------------------------------------
    def wakeup(self) -> None:
        """Make a step() waiting for the replicas return now (a new command is queued)."""
        try:
            self._wake_w.send_bytes(b"w")
        except OSError:
            pass

    def step(self) -> list[RequestOutput]:
        """Outputs of any replica (waits up to a second for one when none is pending)."""
        if not (self._pending or self._failures) and self._requests:
            self._poll(_WAIT_S)
        elif not self._requests:
            self._poll(0)
        return self._take()

    def _take(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.raise_failures and self._failures:
            _, error = self._failures[0]
            self._failures = []
            raise error
        if not any(r.alive for r in self.replicas) and not self._failures and not outputs:
            self._check_alive()
        return outputs

    def pop_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that failed (their replica died) since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def check_health(self) -> None:
        """Notice replicas that died while idle; raise when none is left."""
        self._poll(0)
        self._check_alive()

    def _check_alive(self) -> None:
        if not any(r.alive for r in self.replicas):
            why = "; ".join(f"{r.name}: {r.error}" for r in self.replicas if r.error)
            raise EngineDeadError(f"every data-parallel replica died ({why})")

    def _poll(self, timeout: float) -> None:
        conns = {r.conn: r for r in self.replicas if r.alive and r.conn is not None}
        if not conns:
            return
        ready = mp_connection.wait([*conns, self._wake_r], timeout=timeout)
        if self._wake_r in ready:
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
        for c in ready:
            r = conns.get(c)
            if r is None:
                continue
            try:
                while r.alive and r.conn is not None and r.conn.poll():
                    self._handle(r, r.conn.recv())
            except (EOFError, OSError):
                self._replica_died(r, f"died unexpectedly{self._exit_detail(r)}")

    def _handle(self, r: Replica, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            for out in msg[1]:
                self._on_output(r, out)
            for call, args in msg[2]:
                if call == "record":
                    stats, num_prompt, num_gen, iteration = args
                    self.prom.record(stats, num_prompt, num_gen, iteration, engine=r.rank)
                    if self.stat_loggers is not None and stats is not None:
                        self.stat_loggers[r.rank].record(stats, num_prompt, num_gen)
                else:
                    self.prom.record_iteration(args[0], engine=r.rank)
        elif kind == "reply":
            self._replies.setdefault(r.rank, {})[msg[1]] = msg[2]
        elif kind == "reject":
            t = self._requests.pop(msg[1], None)
            if t is not None:
                self._release(t)
                self._failures.append((msg[1], ValueError(msg[2])))
        elif kind == "dead":
            self._replica_died(r, msg[1])

    def _on_output(self, r: Replica, out: RequestOutput) -> None:
        t = self._requests.get(out.request_id)
        if t is None or t.replica != r.rank:
            return  # aborted, or answered by the replica it was retried away from
        t.delivered = True
        kind = t.kwargs["params"].output_kind
        for c in out.outputs:
            n = len(c.token_ids)
            t.outputs[c.index] = (
                t.outputs.get(c.index, 0) + n if kind == RequestOutputKind.DELTA else n
            )
        progress = sum(t.outputs.values()) + t.prompt_tokens * t.kwargs["params"].n
        step = min(progress, t.cost) - t.done
        if step > 0:
            self.balancer.load[r.rank] -= step
            t.done += step
        if out.finished:
            self._requests.pop(out.request_id, None)
            self._release(t)
        self._pending.append(out)

    def _release(self, t: _Tracked) -> None:
        if self.balancer.alive[t.replica]:
            self.balancer.load[t.replica] -= t.cost - t.done
        t.done = t.cost

    def _replica_died(self, r: Replica, why: str) -> None:
        if not r.alive:
            return
        r.alive, r.error = False, why
        self.balancer.mark_dead(r.rank)
        self.prom.set_idle(r.rank)
        if r.conn is not None:
            try:
                r.conn.close()
            except OSError:
                pass
            r.conn = None
        retried, failed = [], []
        for rid, t in list(self._requests.items()):
            if t.replica != r.rank:
                continue
            if not t.delivered and not t.retried and any(x.alive for x in self.replicas):
                t.retried = True
                t.replica = self.balancer.choose(
                    t.kwargs["prompt_token_ids"], t.kwargs["cache_salt"]
                )
                t.done = 0
                t.outputs = {}
                self.balancer.load[t.replica] += t.cost
                self._send(t.replica, ("add", t.kwargs))
                retried.append(rid)
            else:
                del self._requests[rid]
                failed.append(rid)
                self._failures.append(
                    (
                        rid,
                        ReplicaDeadError(
                            f"{r.name} died: {why} (request {rid} was running there; the "
                            "other replicas keep serving)"
                        ),
                    )
                )
        logger.error(
            "%s died: %s; %d of its requests retried on other replicas, %d failed; %d "
            "replicas left",
            r.name,
            why,
            len(retried),
            len(failed),
            sum(x.alive for x in self.replicas),
        )

    def _send(self, replica: int, msg: tuple) -> None:
        r = self.replicas[replica]
        try:
            r.conn.send(msg)
        except (OSError, AttributeError) as e:
            self._replica_died(r, f"unreachable ({e})")

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Replica.method(*args) on every live replica (rank order); outputs that arrive
        meanwhile are kept for the next step."""
        self._call_id += 1
        cid = self._call_id
        targets = [r for r in self.replicas if r.alive]
        for r in targets:
            self._send(r.rank, ("call", cid, method, args))
        results = []
        for r in targets:
            while r.alive and cid not in self._replies.get(r.rank, {}):
                self._poll(_WAIT_S)
            if r.alive:
                results.append(self._replies[r.rank].pop(cid))
        return results

    # ---- metrics and shutdown ---------------------------------------------------------------
    @property
    def registry(self):
        return self.prom.registry

    def get_metrics(self) -> list[Metric]:
        """Each replica's metrics (label `engine`), then their sums (no `engine` label)."""
        per_engine = get_metrics_snapshot(self.prom.registry)
        return per_engine + sum_over_engines(per_engine)

    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica: alive, its error, and its outstanding tokens and requests."""
        # Called from other threads (the server's /load): copy before iterating.
        counts = collections.Counter(t.replica for t in list(self._requests.values()))
        return [
            {
                "engine": r.rank,
                "alive": r.alive,
                "error": r.error,
                "outstanding_tokens": self.balancer.load[r.rank] if r.alive else 0,
                "requests": counts.get(r.rank, 0),
                "node_ip": r.info.get("node_ip"),
                "pid": r.info.get("pid"),
                "worker_pids": r.info.get("worker_pids"),
            }
            for r in self.replicas
        ]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        for c in (self._wake_r, self._wake_w):
            try:
                c.close()
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
