# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Metric snapshots as plain objects (what `LLM.get_metrics()` returns), read from a
prometheus_client registry; names drop the `_total` suffix of counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from prometheus_client import REGISTRY, CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)


_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _key(labels: dict[str, str], drop: str) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def get_metrics_snapshot(registry: CollectorRegistry | None = None) -> list[Metric]:
    """All vllm:* metrics of the registry, one per label set (a data-parallel front end has
    one per `engine`); per-position counters become one Vector per label set."""
    registry = registry or REGISTRY
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "counter":
            if family.name == _PER_POS:
                per_pos: dict[tuple, dict[int, int]] = {}
                for s in family.samples:
                    if s.name.endswith("_total"):
                        key = _key(s.labels, "position")
                        per_pos.setdefault(key, {})[int(s.labels["position"])] = int(s.value)
                for key, pos in per_pos.items():
                    values = [pos.get(i, 0) for i in range(max(pos) + 1)] if pos else []
                    out.append(Vector(family.name, dict(key), values))
                continue
            for s in family.samples:
                if s.name.endswith("_total"):
                    out.append(Counter(family.name, dict(s.labels), int(s.value)))
        elif family.type == "gauge":
            for s in family.samples:
                out.append(Gauge(family.name, dict(s.labels), float(s.value)))
        elif family.type == "histogram":
            hists: dict[tuple, Histogram] = {}
            for s in family.samples:
                key = _key(s.labels, "le")
                h = hists.get(key)
                if h is None:
                    h = hists[key] = Histogram(family.name, dict(key), 0, 0.0, {})
                if s.name.endswith("_count"):
                    h.count = int(s.value)
                elif s.name.endswith("_sum"):
                    h.sum = float(s.value)
                elif s.name.endswith("_bucket"):
                    h.buckets[s.labels["le"]] = int(s.value)
            out.extend(hists.values())
    return out


# Gauges whose total over replicas means nothing: their mean is given instead.
_MEAN_GAUGES = {"vllm:kv_cache_usage_perc"}


def sum_over_engines(metrics: list[Metric]) -> list[Metric]:
    """One metric per name and label set without `engine`: the sum over the replicas
    (counters, histograms, per-position vectors, request gauges; the KV-cache usage is the
    mean; info metrics are left out). What PromQL's `sum without (engine)` gives."""
    groups: dict[tuple, list[Metric]] = {}
    for m in metrics:
        if "engine" not in m.labels or m.name.endswith("_info"):
            continue
        key = (m.name, type(m), _key(m.labels, "engine"))
        groups.setdefault(key, []).append(m)
    out: list[Metric] = []
    for (name, kind, labels_key), ms in groups.items():
        labels = dict(labels_key)
        if kind is Counter:
            counters = cast(list[Counter], ms)
            out.append(Counter(name, labels, sum(m.value for m in counters)))
        elif kind is Gauge:
            gauges = cast(list[Gauge], ms)
            total = sum(m.value for m in gauges)
            out.append(Gauge(name, labels, total / len(ms) if name in _MEAN_GAUGES else total))
        elif kind is Vector:
            vectors = cast(list[Vector], ms)
            width = max(len(m.values) for m in vectors)
            values = [
                sum(m.values[i] if i < len(m.values) else 0 for m in vectors) for i in range(width)
            ]
            out.append(Vector(name, labels, values))
        elif kind is Histogram:
            hists = cast(list[Histogram], ms)
            buckets: dict[str, int] = {}
            for h in hists:
                for le, c in h.buckets.items():
                    buckets[le] = buckets.get(le, 0) + c
            out.append(
                Histogram(
                    name,
                    labels,
                    sum(h.count for h in hists),
                    sum(h.sum for h in hists),
                    buckets,
                )
            )
    return out
