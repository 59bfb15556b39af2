# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ParallelConfig: Ray is an optional extra, refused with a clear message when it is missing."""

from __future__ import annotations

import sys

import pytest

from vllm.config import ParallelConfig


def test_ray_backend_without_ray_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(
        ValueError, match=r"distributed_executor_backend='ray' needs Ray.*vllm\[ray\]"
    ):
        ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")
    # The other backends never need it.
    assert ParallelConfig(pipeline_parallel_size=2).distributed_executor_backend == "mp"


def test_ray_backend_with_ray() -> None:
    pytest.importorskip("ray")
    cfg = ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert cfg.distributed_executor_backend == "ray"


def test_bad_backend_names_the_field() -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        ParallelConfig(distributed_executor_backend="threads")
