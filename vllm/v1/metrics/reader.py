# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Metric snapshots as plain objects (what `LLM.get_metrics()` returns), read from a
prometheus_client registry; names drop the `_total` suffix of counters."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def get_metrics_snapshot(registry: CollectorRegistry | None = None) -> list[Metric]:
    """All vllm:* metrics of the registry; per-position counters become one Vector."""
    registry = registry or REGISTRY
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "counter":
            if family.name == _PER_POS:
                pos: dict[int, int] = {}
                base: dict[str, str] = {}
                for s in family.samples:
                    if s.name.endswith("_total"):
                        sample_labels = dict(s.labels)
                        pos[int(sample_labels.pop("position"))] = int(s.value)
                        base = sample_labels
                values = [pos.get(i, 0) for i in range(max(pos) + 1)] if pos else []
                out.append(Vector(family.name, base, values))
                continue
            for s in family.samples:
                if s.name.endswith("_total"):
                    out.append(Counter(family.name, dict(s.labels), int(s.value)))
        elif family.type == "gauge":
            for s in family.samples:
                out.append(Gauge(family.name, dict(s.labels), float(s.value)))
        elif family.type == "histogram":
            count, total, buckets = 0, 0.0, {}
            labels: dict[str, str] = {}
            for s in family.samples:
                if s.name.endswith("_count"):
                    count = int(s.value)
                    labels = dict(s.labels)
                elif s.name.endswith("_sum"):
                    total = float(s.value)
                elif s.name.endswith("_bucket"):
                    buckets[s.labels["le"]] = int(s.value)
            out.append(Histogram(family.name, labels, count, total, buckets))
    return out
