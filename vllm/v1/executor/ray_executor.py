# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""RayExecutor: one Ray actor per worker (TP x PP of them, TP rank inner), placed by a
placement group.

Joins the cluster named by RAY_ADDRESS (or an already initialised Ray); otherwise starts a local
Ray with a bounded number of CPUs and shuts it down again with the executor. The actors run the
same Worker as the multiprocessing executor; stages talk over torch.distributed (gloo on CPU,
nccl on CUDA). An actor that raises or dies makes the engine raise at once; every actor is then
killed. So does one that hangs: a step or a health check unanswered for VLLM_PP_STEP_TIMEOUT_S.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor import ray_utils
from vllm.v1.executor.abstract import DistributedExecutorBase
from vllm.v1.executor.multiproc_executor import WorkerFailure, get_open_port
from vllm.v1.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from vllm.v1.worker.worker import Worker

logger = init_logger(__name__)

_POLL_S = 1.0


class RayStage:
    """Actor body: one worker (a pipeline stage's TP rank)."""

    def __init__(self, env: dict[str, str]) -> None:
        envs.apply_vllm_env(env)  # the engine's VLLM_* settings apply on every node
        self.worker: Worker | None = None

    def address(self) -> tuple[str, int]:
        return ray_utils.node_ip(), get_open_port()

    def pid(self) -> int:
        return os.getpid()

    def placement(self) -> dict[str, Any]:
        """Where this worker runs, and (once initialised) the address its gloo groups
        listen on."""
        from vllm.distributed import parallel_state

        return {**ray_utils.placement_info(), "gloo_host": parallel_state.gloo_host()}

    def init_worker(self, vllm_config: VllmConfig, rank: int, init_method: str) -> None:
        from vllm.v1.worker.worker import Worker

        # Its collectives listen on this node's address: a peer on another node reaches it
        # there (the hostname may resolve to a loopback address).
        self.worker = Worker(vllm_config, rank, init_method, host_ip=ray_utils.node_ip())
        self.worker.init_device()
        self.worker.load_model()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.worker is not None, "init_worker() must run first"
        return self.worker.execute_model(so)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


def _summary(error: BaseException) -> str:
    """One line for an actor's error: the stage's own exception when Ray wraps one (its text
    carries the remote traceback, which belongs in the log)."""
    inner = getattr(error, "cause", None)
    if isinstance(inner, BaseException):
        lines = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _stop_actors(state: dict[str, Any]) -> None:
    """Kill the actors, drop the placement group, and stop Ray if this executor started it."""
    import ray

    if not ray.is_initialized():
        return
    for a in state["actors"]:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    state["actors"].clear()
    if state.get("pg") is not None and state.get("own_pg"):
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(state["pg"])
        except Exception:  # noqa: BLE001 - Ray may be shut down already; nothing left to free
            pass
        state["pg"] = None
    if state.get("started_ray"):
        ray.shutdown()
        state["started_ray"] = False


class RayExecutor(DistributedExecutorBase):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = vllm_config.parallel_config
        self.parallel_config = pc
        self.world_size = P = pc.world_size  # actors
        self.output_rank = pc.output_rank
        self.step_timeout_s = envs.VLLM_PP_STEP_TIMEOUT_S  # read now: a bad value fails at start
        self._failed: str | None = None
        self._inflight: deque[list] = deque()
        self._unchecked: list = []  # finished-or-not refs of non-last stages, checked for errors
        self._rank_of: dict[Any, int] = {}  # pending ref -> stage rank
        self._ray = ray
        self._state: dict[str, Any] = {
            "actors": [],
            "pg": None,
            "own_pg": False,
            "started_ray": False,
        }
        self._finalizer = weakref.finalize(self, _stop_actors, self._state)
        use_gpu = vllm_config.device_config.device.startswith("cuda")
        cpus = ray_utils.per_worker_cpus()
        self._state["started_ray"] = ray_utils.ensure_ray(P * cpus)
        try:
            bundles = ray_utils.stage_bundles(pc, use_gpu)
            pg = self._placement_group(bundles)
            env = envs.vllm_env()
            actor_cls = ray.remote(RayStage)
            tp = pc.tensor_parallel_size
            for rank in range(P):
                # The TP ranks of a stage share its bundle, so they share a node.
                actor = actor_cls.options(
                    name=None,
                    num_cpus=cpus,
                    num_gpus=1 if use_gpu else 0,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank // tp
                    ),
                ).remote(env)
                self._state["actors"].append(actor)
            self.actors = list(self._state["actors"])
            ip, port = self._get(self.actors[0].address.remote())
            init_method = f"tcp://{ip}:{port}"
            self._get_all(
                [
                    a.init_worker.remote(vllm_config, r, init_method)
                    for r, a in enumerate(self.actors)
                ]
            )
            self.placement = self._get_all([a.placement.remote() for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "started %d worker actors on Ray (TP %d x PP %d; pids %s), rank -> node: %s",
            P,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            self.worker_pids,
            ", ".join(
                f"{r}: {p['node_ip']} (pid {p['pid']})" for r, p in enumerate(self.placement)
            ),
        )

    def _placement_group(self, bundles: list[ray_utils.Bundle]) -> Any:
        """The placement group of this engine's workers: the one this process runs in (a
        data-parallel replica's, made for it by the front end) when its bundles are the
        stages', else a new PACK group, refused at once when the cluster cannot hold it."""
        import ray

        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) == len(bundles):
            if all(
                all(spec.get(k, 0.0) + 1e-9 >= v for k, v in b.items())
                for spec, b in zip(current.bundle_specs, bundles)
            ):
                self._state["pg"], self._state["own_pg"] = current, False
                return current
        pc = self.parallel_config
        what = (
            f"the {self.world_size} workers "
            f"(TP {pc.tensor_parallel_size} x PP {pc.pipeline_parallel_size})"
        )
        ray_utils.check_placement_feasible([(what, bundles)])
        pg = ray_utils.create_placement_group(bundles, what)
        self._state["pg"], self._state["own_pg"] = pg, True
        return pg

    @property
    def max_concurrent_batches(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    def _who(self, rank: int | str) -> str:
        return self.parallel_config.describe_rank(rank) if isinstance(rank, int) else "a worker"

    @property
    def worker_pids(self) -> list[int]:
        return self._get_all([a.pid.remote() for a in self.actors])

    # ---- transport ----------------------------------------------------------------------
    def _fail(self, msg: str, cause: BaseException | None = None) -> None:
        self._failed = msg
        self.shutdown()
        raise WorkerFailure(msg) from cause

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise WorkerFailure(f"the pipeline stages are stopped after an error: {self._failed}")

    def _get(self, ref) -> Any:
        return self._get_all([ref])[0]

    def _get_all(self, refs: list, timeout: float | None = None, what: str = "") -> list[Any]:
        """Results of refs (one per stage, rank order); raises at the first failure, or when
        (with a timeout) no stage answered for that long."""
        self._rank_of.update({r: i for i, r in enumerate(refs)})
        results: dict[Any, Any] = {}
        pending = list(refs)
        last_progress = time.monotonic()
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for r in ready:
                results[r] = self._unwrap(r, pending)
            if ready:
                last_progress = time.monotonic()
            else:
                self._check_deadline(last_progress, timeout, what, pending)
        return [results[r] for r in refs]

    def _check_deadline(
        self, since: float, timeout: float | None, what: str, pending: list
    ) -> None:
        if timeout is None or time.monotonic() - since < timeout:
            return
        ranks = sorted({self._rank_of.get(r, "?") for r in pending}, key=str)
        who = ", ".join(self._who(r) for r in ranks)
        self._fail(
            f"no answer to {what} from {who} within {timeout:.0f} s "
            "(VLLM_PP_STEP_TIMEOUT_S): a stage hangs"
        )

    def _unwrap(self, ref, others: list) -> Any:
        """ray.get(ref); on failure names the stage, preferring a dead actor among the other
        refs of the step as the cause (its peers only see a broken connection)."""
        ray = self._ray
        rank = self._rank_of.pop(ref, "?")
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:
            cause, culprit = e, rank
            if not isinstance(e, ray.exceptions.RayActorError) and others:
                ready, _ = ray.wait(list(others), num_returns=len(others), timeout=_POLL_S)
                for r in ready:
                    try:
                        ray.get(r)
                    except ray.exceptions.RayActorError as dead:
                        cause, culprit = dead, self._rank_of.get(r, "?")
                        break
                    except ray.exceptions.RayError:
                        pass
            what = "died" if isinstance(cause, ray.exceptions.RayActorError) else "failed"
            logger.error("%s %s:\n%s", self._who(culprit), what, cause)
            self._fail(f"{self._who(culprit)} {what}: {_summary(cause)}", cause)

    def _check_unchecked(self) -> None:
        if not self._unchecked:
            return
        ready, self._unchecked = self._ray.wait(
            self._unchecked, num_returns=len(self._unchecked), timeout=0
        )
        for r in ready:
            self._unwrap(r, self._unchecked)

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        self._check_alive()
        if self._inflight:
            raise RuntimeError(f"collective_rpc({method!r}) while steps are in flight")
        refs = [a.call.remote(method, *args) for a in self.actors]
        return self._get_all(refs, timeout, f"{method}()")

    # ---- executor API -------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        self._check_alive()
        so_ref = self._ray.put(scheduler_output)
        # Pixel values go to the first stage only (the one that runs the encoder).
        rest = scheduler_output.without_pixel_values()
        rest_ref = so_ref if rest is scheduler_output else self._ray.put(rest)
        first_stage = self.parallel_config.tensor_parallel_size
        refs = [
            a.execute_model.remote(so_ref if r < first_stage else rest_ref)
            for r, a in enumerate(self.actors)
        ]
        self._rank_of.update({r: i for i, r in enumerate(refs)})
        self._inflight.append(refs)

    def get_output(self) -> ModelRunnerOutput:
        self._check_alive()
        refs = self._inflight.popleft()
        last = refs[self.output_rank]
        # Watch every worker's call of this step (and earlier unchecked ones): a worker that
        # dies or raises leaves the output rank waiting, so its error must surface instead.
        watch = [last, *(r for r in refs if r is not last), *self._unchecked]
        self._unchecked = []
        timeout = self.step_timeout_s
        last_progress = time.monotonic()
        while True:
            ready, watch = self._ray.wait(watch, num_returns=1, timeout=_POLL_S)
            if ready:
                last_progress = time.monotonic()
            elif last in watch:
                self._check_deadline(last_progress, timeout, "a step", [last])
            for r in ready:
                value = self._unwrap(r, watch)
                if r == last:
                    self._unchecked = watch
                    self._check_unchecked()
                    return value

    def check_health(self) -> None:
        self._check_alive()
        if not self._inflight:
            self.collective_rpc("check_health", timeout=self.step_timeout_s)

    def shutdown(self) -> None:
        self._inflight.clear()
        self._unchecked = []
        self._rank_of.clear()
        self._finalizer()
