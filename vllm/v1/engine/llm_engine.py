# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""LLMEngine: add requests, step (schedule -> execute -> update -> detokenise), abort. What a
prompt goes through before it is scheduled is its InputProcessor's (input_processor.py)."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalInputs
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.engine_inputs import EngineInputs
from vllm.v1.engine.input_processor import check_params
from vllm.v1.engine.output_processor import ChildState, OutputProcessor, RequestState
from vllm.v1.engine.warmup import measure_step_costs, warm_up
from vllm.v1.executor.selector import get_executor_class
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatsRelay
from vllm.v1.metrics.reader import Metric, get_metrics_snapshot
from vllm.v1.metrics.stats import IterationStats, spec_proposer_names
from vllm.v1.request import RequestStatus

logger = init_logger(__name__)


def check_kv_cache_fits(vllm_config: VllmConfig, num_blocks: int) -> None:
    """Refuse a KV cache that cannot hold one request of max_model_len tokens (plus the
    drafts' lookahead), as vLLM does at start-up: such a request would wait for blocks that
    can never exist."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    assert mc.max_model_len is not None
    lookahead = vllm_config.num_speculative_tokens
    need = -(-(mc.max_model_len + lookahead) // cc.block_size)
    if need > num_blocks:
        extra = f" + {lookahead} draft tokens" if lookahead else ""
        raise ValueError(
            f"max_model_len ({mc.max_model_len} tokens{extra}) needs {need} KV cache blocks of "
            f"{cc.block_size} tokens for one request, but the KV cache holds only {num_blocks} "
            f"blocks ({num_blocks * cc.block_size} tokens). Lower max_model_len "
            "(--max-model-len) to at most "
            f"{max(num_blocks * cc.block_size - lookahead, 0)}, or give the KV cache more "
            "memory (--kv-cache-memory-bytes, --gpu-memory-utilization, "
            "num_gpu_blocks_override)."
        )


def num_state_slots(vllm_config: VllmConfig) -> int:
    """Hybrid models (linear-attention layers) keep one state slot per running request."""
    return vllm_config.scheduler_config.max_num_seqs if vllm_config.model_config.is_hybrid else 0


class LLMEngine(EngineInputs):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self._init_inputs(vllm_config)
        mc = self.model_config
        assert mc.max_model_len is not None
        t_phase = self._t_phase
        self.executor = get_executor_class(vllm_config)(vllm_config)
        t_phase = self._phase("load", t_phase)  # workers started, weights loaded
        try:
            num_blocks = self.executor.determine_num_blocks()
            override = vllm_config.cache_config.num_gpu_blocks_override
            if override is not None:
                logger.info(
                    "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d",
                    num_blocks,
                    override,
                )
                num_blocks = override
            check_kv_cache_fits(vllm_config, num_blocks)
            self.executor.initialize_kv_cache(num_blocks)
            t_phase = self._phase("pools", t_phase)
            warm_up(vllm_config, self.executor, num_blocks, num_state_slots(vllm_config))
            t_phase = self._phase("warm-up", t_phase)
            step_costs = measure_step_costs(
                vllm_config, self.executor, num_blocks, num_state_slots(vllm_config)
            )
            if step_costs is not None:
                t_phase = self._phase("step costs", t_phase)
            self.executor.collective_rpc("end_warm_up")
        except BaseException:
            self.executor.shutdown()
            raise
        bs = vllm_config.cache_config.block_size
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max concurrency at max_model_len=%d: "
            "%.1f",
            num_blocks,
            bs,
            num_blocks * bs,
            mc.max_model_len,
            num_blocks * bs / mc.max_model_len,
        )
        self.scheduler = Scheduler(
            vllm_config,
            num_blocks,
            num_state_slots(vllm_config),
            step_costs=step_costs,
            num_state_checkpoints=vllm_config.num_state_checkpoints(),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        k = vllm_config.num_speculative_tokens
        self.prom = PrometheusStatLogger(
            mc.served_model_names[0],
            k,
            max_model_len=mc.max_model_len,
            spec_proposers=spec_proposer_names(vllm_config.speculative_config),
            cache_config_info={
                f.name: str(getattr(vllm_config.cache_config, f.name))
                for f in dataclasses.fields(vllm_config.cache_config)
            },
        )
        self.log_stats = not vllm_config.disable_log_stats
        self.stat_logger: LoggingStatLogger | None = (
            LoggingStatLogger(k) if self.log_stats else None
        )
        self._batch_queue: deque = deque()  # steps in flight (pipeline parallelism)
        self._log_ready(t_phase)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def _check_fits(self, num_prompt_tokens: int) -> None:
        kv = self.scheduler.kv_cache_manager
        if not kv.can_ever_fit(num_prompt_tokens + 1):
            raise ValueError(
                f"the prompt of {num_prompt_tokens} tokens can never fit in the KV cache "
                f"({kv.num_blocks} blocks of {self.scheduler.block_size} tokens)"
            )

    def relay_stats(self) -> StatsRelay:
        """Run as a data-parallel replica: statistics are kept for the front end (which
        records them under this replica's `engine` label and logs them) instead of being
        recorded and logged here."""
        relay = StatsRelay()
        self.prom = relay  # type: ignore[assignment]
        self.stat_logger = None
        return relay

    def check_health(self) -> None:
        """Raise if a worker is dead or hung (the idle liveness check)."""
        self.executor.check_health()

    @property
    def registry(self) -> Any:
        return self.prom.registry

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
        """Add a request whose prompt already went through preprocess (the server does that
        on a tokenizer thread, so a long prompt never holds up the engine thread). seeds: the
        completions' seeds of an unseeded request, drawn by a data-parallel front end (None:
        drawn here)."""
        params = check_params(params)
        self.check_request(params, priority)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids
        arrival_time = arrival_time if arrival_time is not None else time.time()
        requests = self.inputs.make_requests(
            request_id,
            ids,
            params,
            arrival_time,
            cache_salt,
            priority,
            mm_inputs,
            seeds,
            lora_request,
        )
        children = {r.request_id: ChildState(i, r.sampling_params) for i, r in enumerate(requests)}
        self.output_processor.add(
            RequestState(request_id, text, ids, params, children, arrival_time)
        )
        for r in requests:
            self.scheduler.add_request(r)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changes) while requests hold KV blocks."""
        return self.scheduler.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = time.time()
        stats = IterationStats()
        for rid in request_ids:
            st = self.output_processor.requests.get(rid)
            if st is None:
                continue
            self.scheduler.finish_requests(list(st.children), RequestStatus.FINISHED_ABORTED)
            for child in st.children.values():
                if child.finish_reason is None:
                    self.output_processor.record_finished(st, child, "abort", now, stats)
                    child.finish_reason = "abort"
            self.output_processor.remove(rid)
        self.prom.record_iteration(stats)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0 and not so.finished_req_ids:
            return []
        self._mark_scheduled(so)
        return self._process_output(so, self.executor.execute_model(so))

    def _mark_scheduled(self, so) -> None:
        if so.scheduled_new_reqs:
            ids = [r.req_id for r in so.scheduled_new_reqs]
            self.output_processor.mark_scheduled(ids, time.time())

    def _step_pipelined(self) -> list[RequestOutput]:
        """Keep up to max_concurrent_batches steps in flight so pipeline stages overlap: start
        a new batch while there is room and work, otherwise finish the oldest one."""
        limit = self.executor.max_concurrent_batches
        queue = self._batch_queue
        if len(queue) < limit:
            sched = self.scheduler
            # Split the requests across the batches in flight, else one batch takes them all.
            share = -(-min(sched.get_num_unfinished_requests(), sched.max_num_seqs) // limit)
            so = sched.schedule(max_num_reqs=max(1, share))
            if so.total_num_scheduled_tokens or so.finished_req_ids:
                self._mark_scheduled(so)
                so.batches_in_flight = len(queue) + 1
                self.executor.execute_model_async(so)
                queue.append(so)
                if so.total_num_scheduled_tokens and len(queue) < limit:
                    return []
        if not queue:
            return []
        so = queue.popleft()
        return self._process_output(so, self.executor.get_output())

    def _process_output(self, so, runner_out) -> list[RequestOutput]:
        result = self.scheduler.update_from_output(so, runner_out)
        now = time.time()
        iteration = IterationStats()
        outputs, to_abort = self.output_processor.process(result.outputs, now, iteration)
        if to_abort:
            self.scheduler.finish_requests(to_abort, RequestStatus.FINISHED_STOPPED)
        self._record_stats(so, result, iteration)
        for ro in outputs:
            if ro.finished:
                self.output_processor.remove(ro.request_id)
        return outputs

    def _record_stats(self, so, result, iteration: IterationStats) -> None:
        num_prompt = so.num_prompt_tokens
        num_gen = sum(len(out.new_token_ids) for out in result.outputs.values())
        self.prom.record(result.stats, num_prompt, num_gen, iteration)
        if self.stat_logger is not None:
            self.stat_logger.record(result.stats, num_prompt, num_gen)

    def get_metrics(self) -> list[Metric]:
        return get_metrics_snapshot(self.prom.registry)

    def shutdown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
            # Dropped so a shut-down engine cannot step again; only shutdown() sees None.
            self.executor = None  # type: ignore[assignment]

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
