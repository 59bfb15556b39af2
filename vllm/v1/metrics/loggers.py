# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Engine statistics: Prometheus collectors (vLLM's metric names) and a periodic log line."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge as PGauge
from prometheus_client import Histogram as PHistogram

from vllm.logger import init_logger
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

logger = init_logger(__name__)

# Bucket edges as vLLM's, so its Grafana dashboards and alert rules read ours unchanged.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (the token-count histograms' edges)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class PrometheusStatLogger:
    """One registry per engine (front end), so several engines in a process do not collide.
    Names, types, labels (model_name, engine) and bucket edges are vLLM's; a data-parallel
    front end records each replica's statistics under its own `engine` label."""

    def __init__(
        self,
        model_name: str,
        num_spec_tokens: int,
        max_model_len: int = 2048,
        cache_config_info: dict[str, str] | None = None,
        engine_indexes: list[int] | None = None,
        spec_proposers: list[str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.engine_indexes = list(engine_indexes) if engine_indexes is not None else [0]
        self._labels = {
            e: {"model_name": model_name, "engine": str(e)} for e in self.engine_indexes
        }
        self.labels = self._labels[self.engine_indexes[0]]
        self._children: dict[tuple, Any] = {}
        r = self.registry

        def counter(name: str, doc: str, extra: list[str] | None = None) -> PCounter:
            return PCounter(name, doc, labels + (extra or []), registry=r)

        def gauge(name: str, doc: str) -> PGauge:
            return PGauge(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: list) -> PHistogram:
            h = PHistogram(name, doc, labels, buckets=buckets, registry=r)
            for lab in self._labels.values():
                h.labels(**lab)  # exported (empty) before the first observation
            return h

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"]
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        for c in (self.prefix_cache_queries, self.prefix_cache_hits):
            for lab in self._labels.values():
                c.labels(**lab)  # exported (as 0) even when caching is off
        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        per_request = {
            "e2e": ("vllm:e2e_request_latency_seconds", "e2e request latency"),
            "queue": ("vllm:request_queue_time_seconds", "time spent in WAITING phase"),
            "inference": ("vllm:request_inference_time_seconds", "time spent in RUNNING phase"),
            "prefill": ("vllm:request_prefill_time_seconds", "time spent in PREFILL phase"),
            "decode": ("vllm:request_decode_time_seconds", "time spent in DECODE phase"),
        }
        self.latency = {
            key: histogram(
                name, f"Histogram of {doc} for request, in seconds.", REQUEST_LATENCY_BUCKETS
            )
            for key, (name, doc) in per_request.items()
        }
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        if cache_config_info is not None:
            # An info metric as vLLM exports it: a gauge at 1 whose labels carry the config.
            info_gauge = PGauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                [*cache_config_info, "engine"],
                registry=r,
            )
            for e in self.engine_indexes:
                info_gauge.labels(**cache_config_info, engine=str(e)).set(1)
        # Spec-decode counters are always registered; they move once speculation runs.
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["position"],
        )
        # The same three split by who proposed the drafts (a hybrid's two proposers, the
        # grammar's forced tokens); over the proposer label they sum to the totals above.
        self.spec_by_proposer = [
            counter(
                f"vllm:spec_decode_num_{what}_per_proposer", f"{doc}, per proposer.", ["proposer"]
            )
            for what, doc in (
                ("drafts", "Number of spec decoding drafts"),
                ("draft_tokens", "Number of draft tokens"),
                ("accepted_tokens", "Number of accepted tokens"),
            )
        ]
        for lab in self._labels.values():
            if num_spec_tokens:  # exported (as 0) from the start when speculation is on
                for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
                    c.labels(**lab)
            for i in range(num_spec_tokens):
                self.spec_per_pos.labels(**lab, position=str(i))
            for name in spec_proposers or []:
                for c in self.spec_by_proposer:
                    c.labels(**lab, proposer=name)
        self._last_preemptions = dict.fromkeys(self.engine_indexes, 0)

    def _child(self, metric: Any, engine: int, **extra: str) -> Any:
        """metric.labels(...) with the engine's labels, looked up once: the per-token
        histograms are observed for every request every step."""
        key = (id(metric), engine, tuple(extra.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels[engine], **extra)
        return child

    def record(
        self,
        stats: SchedulerStats | None,
        num_prompt: int,
        num_gen: int,
        iteration: IterationStats | None = None,
        engine: int | None = None,
    ) -> None:
        e = self.engine_indexes[0] if engine is None else engine
        self._child(self.prompt_tokens, e).inc(num_prompt)
        self._child(self.generation_tokens, e).inc(num_gen)
        if num_prompt or num_gen:
            self._child(self.iteration_tokens, e).observe(num_prompt + num_gen)
        if stats is not None:
            self._record_scheduler(stats, e)
        if iteration is not None:
            self.record_iteration(iteration, e)

    def _record_scheduler(self, stats: SchedulerStats, e: int) -> None:
        self._child(self.running, e).set(stats.num_running_reqs)
        self._child(self.waiting, e).set(stats.num_waiting_reqs)
        self._child(self.kv_usage, e).set(stats.kv_cache_usage)
        if stats.num_preemptions > self._last_preemptions[e]:
            self._child(self.num_preemptions, e).inc(
                stats.num_preemptions - self._last_preemptions[e]
            )
            self._last_preemptions[e] = stats.num_preemptions
        pc = stats.prefix_cache_stats
        if pc is not None:
            self._child(self.prefix_cache_queries, e).inc(pc.queries)
            self._child(self.prefix_cache_hits, e).inc(pc.hits)
        sd = stats.spec_decoding_stats
        if sd is not None and sd.num_drafts:
            self._child(self.spec_drafts, e).inc(sd.num_drafts)
            self._child(self.spec_draft_tokens, e).inc(sd.num_draft_tokens)
            self._child(self.spec_accepted, e).inc(sd.num_accepted_tokens)
            for i, v in enumerate(sd.num_accepted_tokens_per_pos):
                if v:
                    self._child(self.spec_per_pos, e, position=str(i)).inc(v)
            for name, values in sd.per_proposer.items():
                for c, v in zip(self.spec_by_proposer, values):
                    if v:
                        self._child(c, e, proposer=name).inc(v)

    def set_idle(self, engine: int) -> None:
        """A replica that is gone runs and waits for nothing."""
        self._child(self.running, engine).set(0)
        self._child(self.waiting, engine).set(0)

    def record_iteration(self, it: IterationStats, engine: int | None = None) -> None:
        """The per-request histograms: latencies, finished sequences, request parameters."""
        e = self.engine_indexes[0] if engine is None else engine
        for v in it.time_to_first_tokens_iter:
            self._child(self.ttft, e).observe(v)
        for v in it.inter_token_latencies_iter:
            self._child(self.itl, e).observe(v)
        for n in it.n_params_iter:
            self._child(self.request_params_n, e).observe(n)
        for n in it.max_num_generation_tokens_iter:
            self._child(self.request_max_num_generation_tokens, e).observe(n)
        for f in it.finished_requests:
            self._child(self.request_success, e, finished_reason=f.finish_reason).inc()
            lat = self.latency
            self._child(lat["e2e"], e).observe(f.e2e_latency)
            self._child(lat["queue"], e).observe(f.queued_time)
            self._child(lat["prefill"], e).observe(f.prefill_time)
            self._child(lat["inference"], e).observe(f.inference_time)
            self._child(lat["decode"], e).observe(f.decode_time)
            self._child(self.request_prompt_tokens, e).observe(f.num_prompt_tokens)
            self._child(self.request_generation_tokens, e).observe(f.num_generation_tokens)
            if f.max_tokens_param:
                self._child(self.request_params_max_tokens, e).observe(f.max_tokens_param)


class StatsRelay:
    """Stands in for a data-parallel replica's PrometheusStatLogger: keeps the calls, which the
    replica ships to the front end with its step's outputs, to be recorded there under the
    replica's `engine` label."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def record(
        self,
        stats: SchedulerStats | None,
        num_prompt: int,
        num_gen: int,
        iteration: IterationStats | None = None,
    ) -> None:
        self.calls.append(("record", (stats, num_prompt, num_gen, iteration)))

    def record_iteration(self, it: IterationStats) -> None:
        self.calls.append(("record_iteration", (it,)))

    def drain(self) -> list[tuple[str, tuple]]:
        calls, self.calls = self.calls, []
        return calls


class PrefixCacheHitRate:
    """Hit rate over the most recent requests' lookups (at least max_requests of them), so the
    log shows the current workload rather than the whole history."""

    def __init__(self, max_requests: int = 1000) -> None:
        self.max_requests = max_requests
        self._window: deque[tuple[int, int, int]] = deque()
        self.requests = self.queries = self.hits = 0

    def observe(self, requests: int, queries: int, hits: int, reset: bool = False) -> None:
        if reset:
            self._window.clear()
            self.requests = self.queries = self.hits = 0
        if not requests:
            return
        self._window.append((requests, queries, hits))
        self.requests += requests
        self.queries += queries
        self.hits += hits
        while self.requests - self._window[0][0] >= self.max_requests:
            r, q, h = self._window.popleft()
            self.requests -= r
            self.queries -= q
            self.hits -= h

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class LoggingStatLogger:
    """Every `interval` seconds: throughput, queue sizes, and spec-decode acceptance."""

    def __init__(self, num_spec_tokens: int, interval: float = 5.0, prefix: str = "") -> None:
        self.interval = interval
        self.prefix = prefix  # "Engine 001: " for a data-parallel replica, as vLLM logs
        self.num_spec_tokens = num_spec_tokens
        self.prefix_cache = PrefixCacheHitRate()
        self.prefix_caching_seen = False
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.last = now
        self.prompt = self.gen = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * self.num_spec_tokens

    def record(self, stats: SchedulerStats, num_prompt: int, num_gen: int) -> None:
        self.prompt += num_prompt
        self.gen += num_gen
        pc = stats.prefix_cache_stats
        if pc is not None:
            self.prefix_caching_seen = True
            self.prefix_cache.observe(pc.requests, pc.queries, pc.hits, pc.reset)
        sd = stats.spec_decoding_stats
        if sd is not None:
            self.drafts += sd.num_drafts
            self.draft_tokens += sd.num_draft_tokens
            self.accepted += sd.num_accepted_tokens
            self.per_pos = [a + b for a, b in zip(self.per_pos, sd.num_accepted_tokens_per_pos)]
        now = time.monotonic()
        if now - self.last >= self.interval:
            dt = now - self.last
            msg = self.prefix + (
                f"Avg prompt throughput: {self.prompt / dt:.1f} tokens/s, "
                f"Avg generation throughput: {self.gen / dt:.1f} tokens/s, "
                f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%"
            )
            if self.prefix_caching_seen:
                msg += f", Prefix cache hit rate: {100 * self.prefix_cache.hit_rate:.1f}%"
            logger.info(msg)
            if self.drafts:
                rates = ", ".join(f"{v / self.drafts:.3f}" for v in self.per_pos)
                logger.info(
                    self.prefix
                    + "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                    "Drafted: %d tokens, Per-position acceptance rate: %s, "
                    "Avg Draft acceptance rate: %.1f%%",
                    1 + self.accepted / self.drafts,
                    self.accepted,
                    self.draft_tokens,
                    rates,
                    100 * self.accepted / max(self.draft_tokens, 1),
                )
            self._reset(now)
