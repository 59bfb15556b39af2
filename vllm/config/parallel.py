# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ParallelConfig: how the model is split across pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DistributedExecutorBackend = Literal["mp", "ray", "uni"]


def _ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class ParallelConfig:
    """How the model is split across processes."""

    pipeline_parallel_size: int = 1
    """Number of pipeline stages (one process / Ray actor each)."""
    tensor_parallel_size: int = 1
    """Tensor parallelism (not built: must be 1)."""
    distributed_executor_backend: DistributedExecutorBackend | None = None
    """mp (one process per stage) | ray (one Ray actor per stage) | uni (in this process);
    None picks uni for P = 1 and mp otherwise."""

    def __post_init__(self) -> None:
        p = self.pipeline_parallel_size
        if not isinstance(p, int) or p < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {p!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported "
                "(only 1; use pipeline_parallel_size to split a model)"
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in get_args(DistributedExecutorBackend):
            raise ValueError(
                f"distributed_executor_backend must be 'mp', 'ray' or 'uni', got {backend!r}"
            )
        if backend is None:
            self.distributed_executor_backend = "uni" if p == 1 else "mp"
        elif backend == "uni" and p > 1:
            raise ValueError("distributed_executor_backend='uni' needs pipeline_parallel_size=1")
        elif backend == "ray" and not _ray_installed():
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray, which is not installed: "
                "pip install 'vllm[ray]' (or use distributed_executor_backend='mp')"
            )

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size
