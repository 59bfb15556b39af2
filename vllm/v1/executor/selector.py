# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Which executor runs the workers, by `distributed_executor_backend`: apart from the interface,
so the interface never imports its implementations (each is imported only when chosen: Ray is an
optional extra)."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.executor.abstract import Executor


def get_executor_class(vllm_config: VllmConfig) -> type[Executor]:
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from vllm.v1.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend {backend!r}")
