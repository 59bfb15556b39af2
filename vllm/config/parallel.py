# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ParallelConfig: how the model is split across tensor-parallel ranks and pipeline stages."""

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


# One host's worth of workers (a process or Ray actor each).
_MAX_WORLD_SIZE = 64


@dataclass
class ParallelConfig:
    """How the model is split across processes."""

    pipeline_parallel_size: int = 1
    """Number of pipeline stages (one process / Ray actor each)."""
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks per pipeline stage: each holds 1/TP of every layer's
    heads / intermediate columns / vocabulary rows. World = TP x PP workers, ranks laid out
    TP-inner (rank = pp_rank * TP + tp_rank)."""
    distributed_executor_backend: DistributedExecutorBackend | None = None
    """mp (one process per worker) | ray (one Ray actor per worker) | uni (in this process);
    None picks uni for one worker (TP x PP = 1) and mp otherwise."""

    def __post_init__(self) -> None:
        p = self.pipeline_parallel_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {p!r}")
        t = self.tensor_parallel_size
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {t!r}")
        if self.world_size > _MAX_WORLD_SIZE:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {t} x {p} = "
                f"{self.world_size} workers is more than this engine starts on one host "
                f"({_MAX_WORLD_SIZE})"
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in get_args(DistributedExecutorBackend):
            raise ValueError(
                f"distributed_executor_backend must be 'mp', 'ray' or 'uni', got {backend!r}"
            )
        if backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        elif backend == "uni" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' needs pipeline_parallel_size=1 and "
                "tensor_parallel_size=1"
            )
        elif backend == "ray" and not _ray_installed():
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray, which is not installed: "
                "pip install 'vllm[ray]' (or use distributed_executor_backend='mp')"
            )

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def output_rank(self) -> int:
        """The worker that answers a step: TP rank 0 of the last pipeline stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def describe_rank(self, rank: int) -> str:
        """How error messages name a worker."""
        t = self.tensor_parallel_size
        if t == 1:
            return f"pipeline stage {rank}"
        return f"pipeline stage {rank // t} TP rank {rank % t} (worker {rank})"
