# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Single-process executor (P = 1): the worker lives in the engine process."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.worker = Worker(vllm_config, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Worker.method(*args) on the one worker (as the distributed executors do on every
        stage)."""
        return [getattr(self.worker, method)(*args)]
