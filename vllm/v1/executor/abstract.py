# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Executor interface: hands each SchedulerOutput to the workers and returns the last stage's
ModelRunnerOutput. The scheduler does not know which executor runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput


class Executor(ABC):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            verify_supports_tp(vllm_config)

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call Worker.method(*args) on every stage and return their results (rank order)."""

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine may have in flight at once (P for a pipeline, else 1)."""
        return 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step; its ModelRunnerOutput comes from get_output(), in submission order."""
        self._sync_outputs: deque[ModelRunnerOutput] = getattr(self, "_sync_outputs", deque())
        self._sync_outputs.append(self.execute_model(scheduler_output))

    def get_output(self) -> ModelRunnerOutput:
        """The output of the oldest step started with execute_model_async."""
        return self._sync_outputs.popleft()

    def shutdown(self) -> None:  # noqa: B027 - optional hook: nothing to stop by default
        pass

    def check_health(self) -> None:  # noqa: B027 - optional hook: healthy by default
        pass


def verify_supports_tp(vllm_config: VllmConfig) -> None:
    """Refuse, before any worker starts, a model whose layers are not split over TP ranks."""
    from vllm.model_executor.models.registry import resolve_model_cls

    cls = resolve_model_cls(vllm_config.model_config.architecture)
    if not getattr(cls, "supports_tp", False):
        raise ValueError(
            f"tensor_parallel_size={vllm_config.parallel_config.tensor_parallel_size}: "
            f"{cls.__name__} does not support tensor parallelism yet (supported: Llama, Qwen2)"
        )


class DistributedExecutorBase(Executor):
    """An executor whose stages run in other processes: a step is always started and then
    collected, and every stage answers collective_rpc."""

    @abstractmethod
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> None: ...

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.execute_model_async(scheduler_output)
        return self.get_output()

    def comm_stats(self) -> list[dict[str, float]]:
        return self.collective_rpc("comm_stats")
