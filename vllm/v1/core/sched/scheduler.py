# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Continuous-batching scheduler (pure Python, no torch).

Each step spends a token budget: running requests first (decode: 1 + their draft tokens;
or the next chunk of a prompt), then waiting ones in arrival order. A waiting request starts
after the longest prefix of its tokens found in the prefix cache. When KV blocks run out, the
newest running request is preempted: its blocks are freed (their cached prefix stays reusable)
and it is recomputed later.

Drafts are counted here, never carried: the worker proposes and keeps the draft tokens and
reports how many each request has (ModelRunnerOutput.num_draft_tokens); the scheduler decides
how many of them the next step verifies (its K, the budget, max_model_len) and schedules that
count (SchedulerOutput.num_draft_tokens), which is all its token budget, KV blocks and
acceptance statistics need.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.spec_k import SpecKPolicy, StepCostModel
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.metrics.stats import SchedulerStats, SpecDecodingStats
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

logger = init_logger(__name__)


@dataclass
class SchedulerStepResult:
    outputs: dict[str, EngineCoreOutput] = field(default_factory=dict)
    stats: SchedulerStats | None = None


class Scheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        num_blocks: int,
        num_state_slots: int = 0,
        step_costs: StepCostModel | None = None,
        num_state_checkpoints: int = 0,
    ):
        """num_state_slots / num_state_checkpoints: hybrid models' linear-attention state slots
        (one per running request) and prefix-cache checkpoints (VllmConfig's)."""
        sc = vllm_config.scheduler_config
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.max_model_len = sc.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.num_spec_tokens = vllm_config.num_speculative_tokens
        # Drafts each request verifies per step (the batch-size schedule, adaptive K); an
        # adaptive K needs the step costs measured at start-up (step_costs).
        spec = vllm_config.speculative_config
        self.spec_k = SpecKPolicy(spec, step_costs) if spec is not None else None
        # Who proposed drafts the runner does not label (the metrics' proposer label).
        self.default_proposer = getattr(spec, "method", "")
        self.enable_prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        lc = getattr(vllm_config, "lora_config", None)  # (test doubles may lack it)
        self.max_loras = lc.max_loras if lc is not None else 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.block_size,
            num_state_slots,
            enable_caching=self.enable_prefix_caching,
            # A draft writes its own KV into the target's blocks (see KVCacheManager).
            num_lookahead_tokens=(
                vllm_config.speculative_config.num_lookahead_tokens
                if vllm_config.speculative_config is not None
                else 0
            ),
            num_state_checkpoints=num_state_checkpoints,
            mamba_cache_mode=(
                vllm_config.cache_config.mamba_cache_mode if num_state_checkpoints else "none"
            ),
            # Beyond vLLM, hybrids only: attention-only models keep vLLM's full-block hits.
            cache_prompt_tails=bool(num_state_checkpoints)
            and getattr(vllm_config.cache_config, "mamba_cache_prompt_tail", False),
        )
        self.priority_policy = sc.policy == "priority"
        self._num_added = 0  # ties in priority and arrival time go in the order added
        self._add_order: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._step_id = 0
        # How many of each request's blocks the workers already know about.
        self._sent_blocks: dict[str, int] = {}
        # Requests finished by the scheduler itself (could never fit), reported next update.
        self._failed: dict[str, EngineCoreOutput] = {}

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._add_order[request.request_id] = self._num_added
        self._num_added += 1
        if self.priority_policy:
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def _priority_key(self, req: Request) -> tuple[int, float, int]:
        return (req.priority, req.arrival_time, self._add_order.get(req.request_id, 0))

    def _insert_by_priority(self, req: Request) -> None:
        """Keep `waiting` sorted by (priority, arrival, order added): the front runs next."""
        key = self._priority_key(req)
        i = len(self.waiting)
        while i > 0 and self._priority_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def _free(self, req: Request) -> None:
        if self.spec_k is not None:
            self.spec_k.forget(req.request_id)
        self.kv_cache_manager.free(req)
        self._sent_blocks.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        if not req.in_flight:
            self.requests.pop(req.request_id, None)
            self._add_order.pop(req.request_id, None)

    def _fail_if_never_fits(self, req: Request, num_tokens: int) -> bool:
        """Finish `req` with an error when num_tokens (+ the drafts' lookahead) need more KV
        blocks than the whole pool holds: waiting or preempting cannot help it, and it would
        wait forever. The start-up check (LLMEngine) keeps max_model_len within the pool, so
        this is the guard for what that check cannot see."""
        kvm = self.kv_cache_manager
        need = kvm.blocks_needed(num_tokens + self.num_spec_tokens)
        if need <= kvm.num_blocks:
            return False
        msg = (
            f"request {req.request_id!r} needs {need} KV blocks of {self.block_size} tokens "
            f"for {num_tokens} tokens, but the KV cache holds only {kvm.num_blocks} blocks; it "
            "can never be scheduled (lower max_tokens or max_model_len, or give the KV cache "
            "more memory: kv_cache_memory_bytes / gpu_memory_utilization)"
        )
        logger.error("%s", msg)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        self._failed[req.request_id] = EngineCoreOutput(
            req.request_id, [], finish_reason="error", error=msg
        )
        self._free(req)
        return True

    def _fail_stalled(self, req: Request) -> None:
        """The watchdog: nothing runs, yet the first waiting request could not be scheduled.
        No later step can free anything for it (blocks are freed only by running requests),
        so waiting would never end: finish it with an error that says what it lacked."""
        kvm = self.kv_cache_manager
        _, num_hit = kvm.get_computed_blocks(req)
        n = req.num_tokens - req.num_computed_tokens - num_hit
        need = kvm.blocks_needed(req.num_computed_tokens + num_hit + n + self.num_spec_tokens)
        lacks = (
            f"a prefill of {n} tokens without chunked prefill, more than "
            f"max_num_batched_tokens={self.max_num_batched_tokens}"
            if n > self.max_num_batched_tokens and not self.enable_chunked_prefill
            else f"{need} KV blocks, with {kvm.pool.num_free_blocks} of {kvm.num_blocks} free"
        )
        msg = (
            f"request {req.request_id!r} cannot be scheduled although nothing else is running "
            f"(it needs {lacks}); it would wait forever, so it is finished with an error"
        )
        logger.error("%s", msg)
        self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        self._failed[req.request_id] = EngineCoreOutput(
            req.request_id, [], finish_reason="error", error=msg
        )
        self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling --------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self._sent_blocks.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_drafts = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)  # workers drop the slot; it comes back as new
        if self.priority_policy:
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    def _pick_victim(self) -> Request | None:
        """A running request that is not in flight (its blocks are safe to free): the newest,
        or under the priority policy the one with the lowest priority (largest value), the
        later arrival among equals."""
        candidates = [j for j, r in enumerate(self.running) if not r.in_flight]
        if not candidates:
            return None
        if self.priority_policy:
            j = max(candidates, key=lambda j: self._priority_key(self.running[j]))
        else:
            j = candidates[-1]
        return self.running.pop(j)

    def _lora_fits(self, req: Request) -> bool:
        """Whether req's adapter is running already or a device slot is left for it."""
        lr = req.lora_request
        if lr is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lr.lora_int_id in running or len(running) < self.max_loras

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """max_num_reqs caps the requests of this step (a pipeline spreads its requests over
        the batches it keeps in flight)."""
        budget = self.max_num_batched_tokens
        cap = max_num_reqs if max_num_reqs is not None else self.max_num_seqs
        lookahead = self.num_spec_tokens
        num_scheduled: dict[str, int] = {}
        num_drafts: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted = False
        num_hit_tokens: dict[str, int] = {}
        # The batch-size schedule's ceiling at about this step's batch (a sudden rise in load
        # cuts drafts already proposed).
        est_bs = min(len(self.running) + len(self.waiting), cap, self.max_num_seqs)
        k_cap = self.spec_k.cap(max(est_bs, 1)) if self.spec_k is not None else 0
        if self.spec_k is not None:
            self.spec_k.shape_drafts(self.running, max(est_bs, 1))
        self.kv_cache_manager.checkpoints.new_step()

        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < cap:
            req = self.running[i]
            if req.in_flight:
                i += 1
                continue
            req.num_drafts = min(req.num_drafts, k_cap)
            n = req.num_tokens_with_spec - req.num_computed_tokens
            n = min(n, budget, self.max_model_len - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            if self._fail_if_never_fits(req, req.num_computed_tokens + n):
                continue  # removed from running: i now points at the next request
            scheduled_self = True
            while self.kv_cache_manager.allocate_slots(req, n, lookahead) is None:
                victim = self._pick_victim()
                if victim is None:
                    scheduled_self = False
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    scheduled_self = False
                    break
            if not scheduled_self:
                break
            # Drafts beyond what fits this step are dropped (the budget or max_model_len cut them).
            fits = max(0, req.num_computed_tokens + n - req.num_tokens)
            req.num_drafts = min(req.num_drafts, fits)
            if req.num_drafts:
                num_drafts[req.request_id] = req.num_drafts
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(self._take_new_blocks(req))
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.request_id] = n
            budget -= n
            i += 1

        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.max_num_seqs
            and len(num_scheduled) < cap
        ):
            req = self.waiting[0]
            if not self._lora_fits(req):
                break  # its adapter waits for a slot: max_loras adapters are running
            kvm = self.kv_cache_manager
            hit_blocks, num_hit = kvm.get_computed_blocks(req)
            n = req.num_tokens - req.num_computed_tokens - num_hit
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if self._fail_if_never_fits(req, req.num_computed_tokens + num_hit + n):
                continue
            if kvm.allocate_slots(req, n, lookahead, hit_blocks) is None:
                break
            kvm.record_prefix_cache_lookup(req, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens += num_hit
            num_hit_tokens[req.request_id] = num_hit
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            self._sent_blocks[req.request_id] = len(
                self.kv_cache_manager.get_block_ids(req.request_id)
            )
            assert req.seed is not None  # the engine draws one for unseeded requests
            new_reqs.append(
                NewRequestData(
                    req_id=req.request_id,
                    prefill_token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.sampling_params,
                    seed=req.seed,
                    block_ids=list(self.kv_cache_manager.get_block_ids(req.request_id)),
                    num_computed_tokens=req.num_computed_tokens,
                    state_slot=self.kv_cache_manager.req_to_state_slot.get(req.request_id, -1),
                    state_checkpoint=kvm.restore_checkpoint(req, num_hit),
                    mm_inputs=req.mm_inputs,
                    lora_request=req.lora_request,
                )
            )
            num_scheduled[req.request_id] = n
            budget -= n

        if not num_scheduled and not preempted and self.waiting and not self.running:
            self._fail_stalled(self.waiting[0])
        num_prompt = 0
        saves: dict[str, list[tuple[int, int]]] = {}
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            c = req.num_computed_tokens
            planned = self.kv_cache_manager.plan_checkpoints(req, c, c + n)
            if planned:
                saves[rid] = planned
            # Prompt tokens served from the cache count as processed, as in vLLM.
            start = c - num_hit_tokens.get(rid, 0)
            num_prompt += max(0, min(c + n, req.num_prompt_tokens) - start)
            req.num_computed_tokens += n
            req.in_flight += 1
        num_draft_steps = ks = floor = None
        if self.spec_k is not None and num_scheduled:
            ks = self.spec_k.decide(list(num_scheduled), len(num_scheduled))
            floor = self.spec_k.confidence_floor(len(num_scheduled))
            num_draft_steps = max(ks.values())
            if self.spec_k.force_k is not None:
                # One count forced on every request (the start-up's step-cost measurement):
                # not a decision per request, so the worker runs every step as a drafting
                # batch would (its draft's first pass included).
                ks = None
        finished, self.finished_req_ids = self.finished_req_ids, set()
        self._step_id += 1
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            num_draft_tokens=num_drafts,
            finished_req_ids=finished,
            step_id=self._step_id,
            num_prompt_tokens=num_prompt,
            num_draft_steps=num_draft_steps,
            req_draft_steps=ks,
            draft_confidence_floor=floor,
            state_checkpoint_saves=saves,
            kv_block_copies=self.kv_cache_manager.take_block_copies(),
        )

    def _take_new_blocks(self, req: Request) -> list[int]:
        blocks = self.kv_cache_manager.get_block_ids(req.request_id)
        sent = self._sent_blocks.get(req.request_id, 0)
        self._sent_blocks[req.request_id] = len(blocks)
        return list(blocks[sent:])

    # ---- results -----------------------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> SchedulerStepResult:
        result = SchedulerStepResult()
        result.outputs.update(self._failed)
        self._failed.clear()
        spec_stats = SpecDecodingStats(self.num_spec_tokens) if self.num_spec_tokens else None
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.in_flight -= 1
            if req.is_finished():
                if not req.in_flight:
                    self.requests.pop(rid, None)
                    self._add_order.pop(rid, None)
                continue
            if req.status != RequestStatus.RUNNING:
                continue  # preempted while this step was in flight; it will be recomputed
            idx = runner_out.req_id_to_index[rid]
            sampled = runner_out.sampled_token_ids[idx]
            drafts = sched_out.num_draft_tokens.get(rid, 0)
            out = EngineCoreOutput(rid, [], num_cached_tokens=max(req.num_cached_tokens, 0))
            if drafts and sampled:
                num_accepted = len(sampled) - 1
                req.num_computed_tokens -= drafts - num_accepted
                out.num_draft_tokens, out.num_accepted_tokens = drafts, num_accepted
                if self.spec_k is not None:
                    paths = runner_out.accepted_tree_nodes
                    path = paths[idx] if paths is not None else None
                    greedy = req.sampling_params.temperature == 0.0
                    self.spec_k.observe(rid, drafts, num_accepted, path, greedy)
                if spec_stats is not None:
                    proposer = req.spec_proposer or self.default_proposer
                    spec_stats.observe_draft(drafts, num_accepted, proposer)
            req.num_drafts = 0
            logprobs = runner_out.logprobs[idx] if runner_out.logprobs else None
            for tok in sampled:
                req.append_output_token_ids(tok)
                out.new_token_ids.append(tok)
                if self._check_stop(req):
                    break
            if logprobs is not None:
                out.new_logprobs = logprobs[: len(out.new_token_ids)]
            if rid in runner_out.prompt_logprobs:
                out.prompt_logprobs = runner_out.prompt_logprobs[rid]
            if req.is_finished():
                out.finish_reason = req.get_finished_reason()
                out.stop_reason = req.stop_reason
                self.running.remove(req)
                self._free(req)
            elif runner_out.num_draft_tokens is not None and sampled:
                k = self.spec_k.k_next(rid) if self.spec_k is not None else 0
                req.num_drafts = min(runner_out.num_draft_tokens[idx], k)
                if self.spec_k is not None and self.spec_k.confidence is not None:
                    confs = runner_out.draft_confidences
                    self.spec_k.confidence.on_drafts(rid, confs[idx] if confs else None)
                props = runner_out.draft_proposers
                req.spec_proposer = props[idx] if props is not None else ""
            if out.new_token_ids or out.finish_reason or out.prompt_logprobs:
                result.outputs[rid] = out
        result.stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=spec_stats,
            prefix_cache_stats=self.kv_cache_manager.take_prefix_cache_stats(),
        )
        return result

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. after new weights); False while any request holds
        KV blocks."""
        ok = self.kv_cache_manager.reset_prefix_cache()
        if not ok:
            logger.warning(
                "Failed to reset the prefix cache: %d KV blocks are still in use",
                sum(1 for c in self.kv_cache_manager.pool.ref_cnt if c),
            )
        return ok

    def _check_stop(self, req: Request) -> bool:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= params.min_tokens and last in params.all_stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None if last == params.eos_token_id else last
            return True
        if (
            params.max_tokens is not None and req.num_output_tokens >= params.max_tokens
        ) or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
