# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Starting and stopping the data-parallel front end's replicas: processes (mp backend) or Ray
actors in a placement group each (ray backend), connected to the front end by one pipe /
socket each; a replica that fails to start fails the engine, naming it."""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from multiprocessing import connection as mp_connection
from typing import Any

from vllm import envs
from vllm.config import VllmConfig
from vllm.config.parallel import describe_replica
from vllm.logger import init_logger

logger = init_logger(__name__)

_JOIN_S = 10.0  # a replica's orderly exit at shutdown, before it is killed


# ---- replicas ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Replica:
    """The front end's handle on one replica."""

    rank: int
    conn: Any = None
    process: Any = None  # mp backend
    actor: Any = None  # ray backend
    run_ref: Any = None  # ray: the actor's run() call (ends when the replica does)
    pg: Any = None  # ray: the replica's placement group
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    alive: bool = False
    error: str | None = None

    @property
    def name(self) -> str:
        return describe_replica(self.rank)


def _stop_replicas(state: dict[str, Any]) -> None:
    """Ask every replica to stop, then end whatever is still running: processes, actors,
    placement groups, and the local Ray this front end started."""
    replicas: list[Replica] = state["replicas"]
    for r in replicas:
        if r.conn is not None:
            try:
                r.conn.send(("shutdown",))
            except Exception:  # noqa: BLE001 - already gone
                pass
    deadline = time.monotonic() + _JOIN_S
    for r in replicas:
        if r.process is not None:
            r.process.join(max(0.0, deadline - time.monotonic()))
    refs = [r.run_ref for r in replicas if r.run_ref is not None]
    if refs:
        import ray

        if ray.is_initialized():
            try:
                ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - Ray is going away
                pass
    for r in replicas:
        if r.process is not None and r.process.is_alive():
            r.process.kill()
            r.process.join(5.0)
        if r.conn is not None:
            try:
                r.conn.close()
            except OSError:
                pass
            r.conn = None
        r.alive = False
    if any(r.actor is not None or r.pg is not None for r in replicas) or state.get("started_ray"):
        import ray

        if ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            for r in replicas:
                if r.actor is not None:
                    try:
                        ray.kill(r.actor, no_restart=True)
                    except Exception:  # noqa: BLE001 - already dead
                        pass
                    r.actor = None
                if r.pg is not None:
                    try:
                        remove_placement_group(r.pg)
                    except Exception:  # noqa: BLE001 - freed with the cluster
                        pass
                    r.pg = None
            if state.get("started_ray"):
                ray.shutdown()
                state["started_ray"] = False
    listener = state.get("listener")
    if listener is not None:
        try:
            listener.close()
        except OSError:
            pass
        state["listener"] = None


class ReplicaLauncher:
    """DPEngine's start-up half (a mixin): starts self.replicas and waits for them."""

    vllm_config: VllmConfig
    num_replicas: int
    replicas: list[Replica]
    _state: dict[str, Any]

    # ---- start-up ---------------------------------------------------------------------------
    def _replica_config(self, rank: int) -> VllmConfig:
        cfg = dataclasses.replace(self.vllm_config)
        cfg.parallel_config = dataclasses.replace(
            self.vllm_config.parallel_config, data_parallel_rank=rank
        )
        return cfg

    def _start_mp(self) -> None:
        from vllm.v1.engine.dp_replica import replica_process_main, split_cores, usable_core_ids
        from vllm.v1.executor.multiproc_executor import _mp_context

        ctx = _mp_context(self.vllm_config)
        cores = split_cores(self.num_replicas, usable_core_ids())
        env = envs.vllm_env()
        for r in self.replicas:
            parent, child = ctx.Pipe(duplex=True)
            # Not a daemon: a replica starts its own worker processes (TP x PP > 1).
            proc = ctx.Process(
                target=replica_process_main,
                args=(child, self._replica_config(r.rank), cores[r.rank], env),
                name=f"VllmDPReplica-{r.rank}",
                daemon=False,
            )
            proc.start()
            child.close()
            r.process, r.conn, r.alive = proc, parent, True

    def _start_ray(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from vllm.v1.engine.dp_replica import RayReplica, split_cores
        from vllm.v1.executor import ray_utils

        pc = self.vllm_config.parallel_config
        use_gpu = self.vllm_config.device_config.device.startswith("cuda")
        cpus = ray_utils.per_worker_cpus()
        ray_workers = pc.distributed_executor_backend == "ray"
        if ray_workers:
            bundles = ray_utils.stage_bundles(pc, use_gpu)
        else:  # one worker, in the replica's own actor
            bundles = [{"CPU": cpus, **({"GPU": 1.0} if use_gpu else {})}]
        self._state["started_ray"] = ray_utils.ensure_ray(
            self.num_replicas * sum(b["CPU"] for b in bundles)
        )
        ray_utils.check_placement_feasible([(r.name, bundles) for r in self.replicas])
        address = (
            pc.data_parallel_address or ray_utils.node_ip(),
            pc.data_parallel_rpc_port or 0,
        )
        authkey = secrets.token_bytes(32)
        listener = mp_connection.Listener(address, authkey=authkey)
        self._state["listener"] = listener
        env = envs.vllm_env()
        actor_cls = ray.remote(RayReplica)
        for r in self.replicas:
            r.pg = ray_utils.create_placement_group([dict(b) for b in bundles], r.name)
            r.actor = actor_cls.options(
                name=None,
                # The replica's own engine (scheduler, and the worker when it has one) holds
                # the bundle's CPU; with Ray workers they hold it and the replica is light.
                num_cpus=0 if ray_workers else cpus,
                num_gpus=0 if ray_workers or not use_gpu else 1,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=r.pg, placement_group_bundle_index=0
                ),
            ).remote(env)
        hosts = ray.get([r.actor.host_info.remote() for r in self.replicas])
        # Replicas on one physical host (simulated nodes share it) get disjoint cores.
        by_host: dict[str, list[int]] = {}
        for r, h in zip(self.replicas, hosts):
            r.info.update(node_ip=h["node_ip"], node_id=h["node_id"])
            by_host.setdefault(h["host"], []).append(r.rank)
        cores: dict[int, list[int] | None] = {}
        for ranks in by_host.values():
            want = [0 if ray_workers else max(1, int(-(-cpus // 1)))] * len(ranks)
            split = split_cores(len(ranks), hosts[ranks[0]]["cores"], want)
            for rank, c, w in zip(ranks, split, want):
                cores[rank] = c if w else None
        for r in self.replicas:
            r.run_ref = r.actor.run.remote(
                listener.address, authkey, self._replica_config(r.rank), cores[r.rank]
            )
        self._accept(listener)

    def _accept(self, listener: Any) -> None:
        """Take each Ray replica's connection, watching the actors meanwhile (one that fails
        before it connects never will)."""
        import queue

        import ray

        conns: queue.SimpleQueue = queue.SimpleQueue()

        def accept() -> None:
            for _ in self.replicas:
                try:
                    conns.put(listener.accept())
                except Exception as e:  # noqa: BLE001 - reported below
                    conns.put(e)
                    return

        threading.Thread(target=accept, name="dp-accept", daemon=True).start()
        waiting = {r.rank for r in self.replicas}
        by_ref = {r.run_ref: r for r in self.replicas}
        while waiting:
            try:
                conn = conns.get(timeout=0.5)
            except queue.Empty:
                done, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
                for ref in done:
                    r = by_ref[ref]
                    if r.rank in waiting:
                        try:
                            ray.get(ref)
                            why = "ended before connecting"
                        except Exception as e:  # noqa: BLE001 - the actor's error
                            why = f"failed: {_one_line(e)}"
                        raise RuntimeError(f"{r.name} {why}") from None
                continue
            if isinstance(conn, BaseException):
                raise RuntimeError(f"the data-parallel listener failed: {conn}")
            hello = conn.recv()
            rank = hello[1]
            self.replicas[rank].conn, self.replicas[rank].alive = conn, True
            waiting.discard(rank)

    def _wait_ready(self) -> None:
        """Every replica's ("ready", info); any failing to start fails the engine, naming it."""
        waiting = {r.rank for r in self.replicas}
        while waiting:
            conns = {self.replicas[i].conn: self.replicas[i] for i in waiting}
            for c in mp_connection.wait(list(conns)):
                r = conns[c]
                try:
                    msg = r.conn.recv()
                except (EOFError, OSError):
                    raise RuntimeError(
                        f"{r.name} died while starting{self._exit_detail(r)}"
                    ) from None
                if msg[0] == "ready":
                    r.info.update(msg[1])
                    waiting.discard(r.rank)
                elif msg[0] == "dead":
                    raise RuntimeError(f"{r.name} {msg[1]}")

    def _exit_detail(self, r: Replica) -> str:
        if r.process is not None:
            r.process.join(1.0)
            return f" (pid {r.process.pid}, exit code {r.process.exitcode})"
        if r.run_ref is not None:
            import ray

            try:
                ray.get(r.run_ref, timeout=1.0)
            except Exception as e:  # noqa: BLE001 - the actor's fate
                return f" ({_one_line(e)})"
        return ""


def _one_line(e: BaseException) -> str:
    inner = getattr(e, "cause", None)
    if isinstance(inner, BaseException):
        e = inner
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
