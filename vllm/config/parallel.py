# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""ParallelConfig: how the model is split across tensor-parallel ranks and pipeline stages, and
how many engine replicas (data parallelism) serve it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DistributedExecutorBackend = Literal["mp", "ray", "uni"]
DataParallelBackend = Literal["mp", "ray"]


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
    None picks uni for one worker (TP x PP = 1), ray under data_parallel_backend='ray', and
    mp otherwise."""
    data_parallel_size: int = 1
    """Engine replicas (data parallelism), each with its own scheduler, KV cache and TP x PP
    workers, behind one front end that sends each request to the replica with the fewest
    outstanding tokens."""
    data_parallel_size_local: int | None = None
    """Replicas started on this host: with data_parallel_backend='mp' all of them (None:
    data_parallel_size); with 'ray' Ray places the replicas and this field is not used."""
    data_parallel_address: str | None = None
    """Address the front end listens on for its replicas' connections (None: 127.0.0.1 with
    the mp backend, this node's Ray IP with the ray backend)."""
    data_parallel_rpc_port: int | None = None
    """Port of that listener (None: a free one)."""
    data_parallel_backend: DataParallelBackend | None = None
    """mp (one process per replica on this host) | ray (one Ray actor per replica, each
    replica's workers in its own placement group, spread over the cluster's nodes); None: ray
    when distributed_executor_backend is 'ray', else mp."""
    data_parallel_rank: int = 0
    """Which replica this configuration runs (set by the front end for each replica)."""

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
        dp_backend = self._verify_data_parallel()
        if backend is None:
            if self.world_size == 1:
                self.distributed_executor_backend = "uni"
            else:
                self.distributed_executor_backend = "ray" if dp_backend == "ray" else "mp"
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

    def _verify_data_parallel(self) -> str:
        """Check the data-parallel fields (errors name the field); returns the resolved
        data_parallel_backend."""
        d = self.data_parallel_size
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {d!r}")
        if d * self.world_size > _MAX_WORLD_SIZE * 4:
            raise ValueError(
                f"data_parallel_size x tensor_parallel_size x pipeline_parallel_size = {d} x "
                f"{self.world_size} workers is more than this engine starts "
                f"({_MAX_WORLD_SIZE * 4})"
            )
        local = self.data_parallel_size_local
        if local is not None and (
            not isinstance(local, int) or isinstance(local, bool) or not 1 <= local <= d
        ):
            raise ValueError(
                f"data_parallel_size_local must be an integer in [1, data_parallel_size={d}], "
                f"got {local!r}"
            )
        addr = self.data_parallel_address
        if addr is not None and (not isinstance(addr, str) or not addr.strip()):
            raise ValueError(f"data_parallel_address must be a host name or IP, got {addr!r}")
        port = self.data_parallel_rpc_port
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535
        ):
            raise ValueError(
                f"data_parallel_rpc_port must be an integer in [0, 65535], got {port!r}"
            )
        rank = self.data_parallel_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < d:
            raise ValueError(
                f"data_parallel_rank must be in [0, data_parallel_size={d}), got {rank!r}"
            )
        dp_backend = self.data_parallel_backend
        if dp_backend is not None and dp_backend not in get_args(DataParallelBackend):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {dp_backend!r}")
        if dp_backend is None:
            dp_backend = "ray" if self.distributed_executor_backend == "ray" else "mp"
            # Resolved only when it matters, so a plain config stays as it was given.
            if d > 1:
                self.data_parallel_backend = dp_backend
        if self.data_parallel_backend == "ray" and not _ray_installed():
            raise ValueError(
                "data_parallel_backend='ray' needs Ray, which is not installed: "
                "pip install 'vllm[ray]' (or use data_parallel_backend='mp')"
            )
        if d > 1 and dp_backend == "mp":
            if local is not None and local != d:
                raise ValueError(
                    f"data_parallel_size_local={local}: with data_parallel_backend='mp' every "
                    f"replica runs on this host (data_parallel_size={d}); replicas on other "
                    "nodes are placed by data_parallel_backend='ray'"
                )
            if self.distributed_executor_backend == "ray":
                raise ValueError(
                    "data_parallel_backend='mp' with distributed_executor_backend='ray': Ray "
                    "workers of several replicas are placed by data_parallel_backend='ray'"
                )
        if dp_backend == "ray" and self.distributed_executor_backend == "mp":
            raise ValueError(
                "data_parallel_backend='ray' places each replica's workers as Ray actors: "
                "distributed_executor_backend must be 'ray' (or unset), got 'mp'"
            )
        return dp_backend

    @property
    def uses_dp_front_end(self) -> bool:
        """Whether the engine is a front end over replica engines: several replicas, or one
        replica placed by Ray (its engine runs on a cluster node)."""
        return self.data_parallel_size > 1 or self.data_parallel_backend == "ray"

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
            who = f"pipeline stage {rank}"
        else:
            who = f"pipeline stage {rank // t} TP rank {rank % t} (worker {rank})"
        if self.data_parallel_size > 1:
            who = f"{describe_replica(self.data_parallel_rank)}'s {who}"
        return who


def describe_replica(rank: int) -> str:
    """How logs and errors name a data-parallel replica (its metrics' `engine` label)."""
    return f"data-parallel replica {rank} (engine {rank})"
