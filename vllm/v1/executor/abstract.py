# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Executor interface: hands each SchedulerOutput to the workers and returns the last stage's
ModelRunnerOutput. The scheduler does not know which executor runs."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
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

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        pass

    def check_health(self) -> None:
        pass
