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
from vllm.v1.metrics.stats import SchedulerStats

logger = init_logger(__name__)

_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]


class PrometheusStatLogger:
    """One registry per engine, so several engines in a process do not collide."""

    def __init__(self, model_name: str, num_spec_tokens: int) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}
        self._children: dict[tuple, Any] = {}
        r = self.registry

        def counter(name: str, doc: str, extra: list[str] | None = None) -> PCounter:
            return PCounter(name, doc, labels + (extra or []), registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        self.request_success = counter(
            "vllm:request_success", "Finished requests.", ["finished_reason"]
        )
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens of new requests looked up in the cache."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens of new requests found in the cache."
        )
        for c in (self.prefix_cache_queries, self.prefix_cache_hits):
            c.labels(**self.labels)  # exported (as 0) even when caching is off
        self.running = PGauge("vllm:num_requests_running", "Running requests.", labels, registry=r)
        self.waiting = PGauge("vllm:num_requests_waiting", "Waiting requests.", labels, registry=r)
        self.kv_usage = PGauge("vllm:kv_cache_usage_perc", "KV cache usage.", labels, registry=r)
        self.ttft = PHistogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = PHistogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = PHistogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Spec-decode counters are always registered; they move once speculation runs.
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Draft proposals.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.")
        self.spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens."
        )
        self.spec_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens per draft position.",
            ["position"],
        )
        for i in range(num_spec_tokens):
            self.spec_per_pos.labels(**self.labels, position=str(i))
        self._last_preemptions = 0

    def _child(self, metric: Any, **extra: str) -> Any:
        """metric.labels(...) with this engine's labels, looked up once: the per-token
        histograms are observed for every request every step."""
        key = (id(metric), tuple(extra.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def record(self, stats: SchedulerStats, num_prompt: int, num_gen: int) -> None:
        self._child(self.prompt_tokens).inc(num_prompt)
        self._child(self.generation_tokens).inc(num_gen)
        self._child(self.running).set(stats.num_running_reqs)
        self._child(self.waiting).set(stats.num_waiting_reqs)
        self._child(self.kv_usage).set(stats.kv_cache_usage)
        if stats.num_preemptions > self._last_preemptions:
            self._child(self.num_preemptions).inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        pc = stats.prefix_cache_stats
        if pc is not None:
            self._child(self.prefix_cache_queries).inc(pc.queries)
            self._child(self.prefix_cache_hits).inc(pc.hits)
        sd = stats.spec_decoding_stats
        if sd is not None and sd.num_drafts:
            self._child(self.spec_drafts).inc(sd.num_drafts)
            self._child(self.spec_draft_tokens).inc(sd.num_draft_tokens)
            self._child(self.spec_accepted).inc(sd.num_accepted_tokens)
            for i, v in enumerate(sd.num_accepted_tokens_per_pos):
                if v:
                    self._child(self.spec_per_pos, position=str(i)).inc(v)

    def record_finished(self, reason: str, e2e: float) -> None:
        self._child(self.request_success, finished_reason=reason).inc()
        self._child(self.e2e).observe(e2e)

    def record_ttft(self, seconds: float) -> None:
        self._child(self.ttft).observe(seconds)

    def record_itl(self, seconds: float) -> None:
        self._child(self.itl).observe(seconds)


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

    def __init__(self, num_spec_tokens: int, interval: float = 5.0) -> None:
        self.interval = interval
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
            msg = (
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
                    "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                    "Drafted: %d tokens, Per-position acceptance rate: %s, "
                    "Avg Draft acceptance rate: %.1f%%",
                    1 + self.accepted / self.drafts,
                    self.accepted,
                    self.draft_tokens,
                    rates,
                    100 * self.accepted / max(self.draft_tokens, 1),
                )
            self._reset(now)
