# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Worker: one per (pipeline stage, tensor-parallel rank); owns the device, its shard of the
stage's model slice and its KV cache."""

from __future__ import annotations

import os
import time
from collections import deque

import torch

from vllm import envs
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import (
    PendingSend,
    destroy_distributed,
    get_pp_group,
    get_tp_group,
    init_distributed,
    recv_tensor_dict,
    send_tensor_dict,
)
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.cpu_memory import configure_cpu_process_memory
from vllm.v1.worker.gpu.model_runner import ModelRunner

logger = init_logger(__name__)


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class Worker:
    def __init__(
        self,
        vllm_config: VllmConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
        host_ip: str | None = None,
    ) -> None:
        if vllm_config.device_config.device == "cpu":
            configure_cpu_process_memory()
        self.vllm_config = vllm_config
        pc = vllm_config.parallel_config
        self.rank = rank
        # Pipeline stages (the send / receive pipeline); every worker of the run: world.
        self.world_size = pc.pipeline_parallel_size
        self.tp_size = pc.tensor_parallel_size
        self.num_workers = pc.world_size
        self.distributed_init_method = distributed_init_method
        # The address its gloo collectives bind to (VLLM_HOST_IP wins; a Ray worker passes
        # its node's IP).
        self.host_ip = envs.VLLM_HOST_IP or host_ip
        self.device = torch.device(vllm_config.device_config.device)
        self.model_runner: ModelRunner | None = None
        # Stage-to-stage sends not reaped yet; at most one per batch in flight (world_size).
        self._pending_sends: deque[PendingSend] = deque()
        # The VLLM_TEST_FAULT_RAISE test hook (None: off) and its step count.
        self._fault: tuple[int, str, int] | None = envs.VLLM_TEST_FAULT_RAISE
        self._fault_steps = 0
        # CPU stages without OMP_NUM_THREADS: (threads for a step run alone, threads when
        # steps overlap); None: the thread count is never changed per step.
        self._cpu_threads: tuple[int, int] | None = None
        # Steps and seconds spent in stage-to-stage transfers (see comm_stats).
        self._comm = {
            "steps": 0,
            "run_s": 0.0,
            "run_cpu_s": 0.0,
            "recv_wait_s": 0.0,
            "recv_payload_s": 0.0,
            "send_s": 0.0,
            # CPU stages choosing their thread count per step: steps run alone / overlapping
            "steps_alone": 0,
            "steps_shared": 0,
        }
        # record_drafts(): every draft proposal of this stage per request (None: off).
        self._draft_log: dict[str, list[list[int]]] | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        if self.num_workers > 1:
            if self.distributed_init_method is None:
                raise ValueError(
                    "tensor_parallel_size x pipeline_parallel_size > 1 needs a "
                    "distributed_init_method"
                )
            if self.device.type == "cpu" and envs.OMP_NUM_THREADS is None:
                # Workers share the host's cores (those this process may run on: a
                # data-parallel replica's); oversubscribing them slows every one. A step the
                # stages run one after another (nothing else in flight) may use the cores
                # of every stage: the others wait meanwhile (_stage_threads).
                cores = usable_cores()
                shared = max(1, cores // self.num_workers)
                self._cpu_threads = (max(1, cores // self.tp_size), shared)
                torch.set_num_threads(shared)
            init_distributed(
                self.rank,
                self.num_workers,
                self.distributed_init_method,
                backend="nccl" if self.device.type == "cuda" else "gloo",
                device=self.device if self.device.type == "cuda" else None,
                tensor_parallel_size=self.tp_size,
                host_ip=self.host_ip,
            )
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.model_runner = ModelRunner(self.vllm_config, self.device)

    def _runner(self) -> ModelRunner:
        # Set by init_device(); every later step needs it.
        assert self.model_runner is not None, "init_device() must run first"
        return self.model_runner

    def load_model(self) -> None:
        self._runner().load_model()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget, capped at what max_num_seqs could ever use."""
        cc = self.vllm_config.cache_config
        per_block = self._runner().kv_cache_bytes_per_block()
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cc.gpu_memory_utilization) - used
        else:
            gib = envs.VLLM_CPU_KVCACHE_SPACE
            budget = int(gib * (1 << 30))
        # Hybrid models: the linear-attention states (one slot per running request, and the
        # prefix cache's checkpoints) come first.
        states = self._runner().state_cache_bytes()
        if states and states >= budget:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) does not hold the linear-attention "
                f"states of max_num_seqs requests and their mamba_num_checkpoints prefix-cache "
                f"checkpoints ({states} bytes); raise kv_cache_memory_bytes / "
                "gpu_memory_utilization or lower max_num_seqs / mamba_num_checkpoints"
            )
        budget -= states
        if per_block == 0:
            return self._runner().max_useful_blocks()
        n = min(budget // per_block, self._runner().max_useful_blocks())
        if n <= 0:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) does not hold one block of "
                f"{per_block} bytes; raise kv_cache_memory_bytes / gpu_memory_utilization"
            )
        return int(n)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner().initialize_kv_cache(num_blocks)

    def execute_model(self, so: SchedulerOutput, intermediate_tensors=None):
        """Run this stage. P > 1: non-first stages receive IntermediateTensors from the previous
        stage, non-last stages send theirs on (non-blocking) and return None."""
        if self._fault is not None:
            self._maybe_fail(so)
        if self.world_size == 1:
            self._comm["steps"] += 1
            return self._log_drafts(self._runner().execute_model(so, intermediate_tensors))
        pp = get_pp_group()
        self._stage_threads(so)
        if not pp.is_first_rank and so.total_num_scheduled_tokens > 0:
            intermediate_tensors = IntermediateTensors(self._recv(pp.prev_rank))
        t0, c0 = time.perf_counter(), time.process_time()
        out = self._runner().execute_model(so, intermediate_tensors)
        self._comm["run_s"] += time.perf_counter() - t0
        self._comm["run_cpu_s"] += time.process_time() - c0
        if pp.is_last_rank:
            return self._log_drafts(out)
        if isinstance(out, IntermediateTensors):
            t0 = time.perf_counter()
            self._reap_sends(keep=self.world_size - 1)
            self._pending_sends.append(send_tensor_dict(out.tensors, pp.next_rank))
            self._comm["send_s"] += time.perf_counter() - t0
        return None

    def _stage_threads(self, so: SchedulerOutput) -> None:
        """CPU, P > 1: a step run alone (so.batches_in_flight == 1, e.g. batch 1: one stage
        computes while the others wait for it) gets the cores of every stage (this TP rank's
        share); overlapping steps get this worker's share, so the stages computing at once
        never oversubscribe the cores. The output does not change: the small-M kernel computes
        each output element in one thread, and outputs at P = 1 (every core) and P > 1 are
        held equal by the tests."""
        if self._cpu_threads is None or so.total_num_scheduled_tokens == 0:
            return
        alone, shared = self._cpu_threads
        run_alone = so.batches_in_flight <= 1
        want = alone if run_alone else shared
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        self._comm["steps_alone" if run_alone else "steps_shared"] += 1

    def _maybe_fail(self, so: SchedulerOutput) -> None:
        """The VLLM_TEST_FAULT_RAISE test hook: raise as a failing forward would."""
        assert self._fault is not None
        rank, marker, n = self._fault
        if rank != self.rank or not any(marker in rid for rid in so.num_scheduled_tokens):
            return
        self._fault_steps += 1
        if self._fault_steps == n:
            raise RuntimeError(f"injected fault in the forward (VLLM_TEST_FAULT_RAISE={marker})")

    def _reap_sends(self, keep: int) -> None:
        """Free the tensors of sends the next stage has taken, keeping at most `keep` posted.

        Over gloo a send's is_completed() stays False until wait() is called, so dropping only
        completed sends kept every step's tensors forever. The engine keeps at most world_size
        batches in flight, so a send older than that was received (its batch's output came
        back before this batch started): waiting on it returns at once. The newest sends stay
        posted, so this stage never waits for the next one to catch up (pipelining)."""
        pending = self._pending_sends
        while pending and (len(pending) > keep or pending[0].is_completed()):
            pending.popleft().wait()

    def pending_sends(self) -> dict[str, int]:
        """Sends this stage posted and still holds: stage-to-stage tensors and (last stage)
        the broadcasts of sampled tokens (tests assert both stay bounded)."""
        handler = self.model_runner.pp_handler if self.model_runner else None
        return {
            "p2p": len(self._pending_sends),
            "broadcast": handler.num_pending_sends if handler is not None else 0,
        }

    def _recv(self, src: int) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        buffers = self._runner().recv_buffers
        assert buffers is not None, "a stage that receives has receive buffers"
        tensors = recv_tensor_dict(src, buffers, on_metadata=self._on_metadata)
        now = time.perf_counter()
        # Waiting for the metadata includes the upstream stage's compute (pipeline bubble);
        # what follows it is the transfer proper.
        self._comm["recv_wait_s"] += self._meta_t - t0
        self._comm["recv_payload_s"] += now - self._meta_t
        self._comm["steps"] += 1
        return tensors

    def _on_metadata(self) -> None:
        self._meta_t = time.perf_counter()

    def comm_stats(self) -> dict[str, float]:
        """Seconds this stage spent on pipeline communication so far."""
        handler = self.model_runner.pp_handler if self.model_runner else None
        bcast = handler.recv_wait_s if handler is not None else 0.0
        mm = self.model_runner.mm if self.model_runner else None
        tp = get_tp_group()
        return dict(
            self._comm,
            rank=self.rank,
            broadcast_wait_s=bcast,
            tp_comm_s=tp.comm_s,
            tp_collectives=tp.num_collectives,
            mm_pixel_bytes=(mm.pixel_bytes_received if mm is not None else 0),
            threads_alone=self._cpu_threads[0] if self._cpu_threads else 0,
            threads_shared=self._cpu_threads[1] if self._cpu_threads else 0,
            threads_now=torch.get_num_threads(),
        )

    def record_drafts(self) -> None:
        """From now on keep each request's draft proposals (draft_log). The drafts' values
        never leave the worker in a step's output (the scheduler receives their counts), so
        this is how a caller compares what two configurations proposed."""
        self._draft_log = {}

    def draft_log(self) -> dict[str, list[list[int]]] | None:
        """Since record_drafts(): per request, the drafts proposed after each step that
        sampled for it, in order (a row of K, PAD_TOKEN_ID where none). None on a stage that
        does not propose, or when not recording."""
        runner = self.model_runner
        return self._draft_log if runner is not None and runner.speculator is not None else None

    def _log_drafts(
        self, out: ModelRunnerOutput | IntermediateTensors | None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        log, runner = self._draft_log, self.model_runner
        if log is None or runner is None or not isinstance(out, ModelRunnerOutput):
            return out
        if out.num_draft_tokens is None:
            return out
        st = runner.states
        for rid, i in out.req_id_to_index.items():
            if out.sampled_token_ids[i]:
                log.setdefault(rid, []).append(st.draft_tokens[st.slot(rid)].tolist())
        return out

    def check_health(self) -> bool:
        return True

    def end_warm_up(self) -> None:
        """Start-up is over: state learned from the warm-up's dummy requests is dropped."""
        runner = self.model_runner
        if runner is not None and runner.speculator is not None:
            runner.speculator.end_warm_up()

    def shutdown(self) -> None:
        self._pending_sends.clear()
        if self.num_workers > 1:
            destroy_distributed()
