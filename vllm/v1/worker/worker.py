# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Worker: one per pipeline stage; owns the device, the model slice and its KV cache."""

from __future__ import annotations

import os

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu.model_runner import ModelRunner

logger = init_logger(__name__)

_CPU_KV_DEFAULT_GIB = 2.0


class Worker:
    def __init__(self, vllm_config: VllmConfig, rank: int = 0) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.device = torch.device(vllm_config.device_config.device)
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.model_runner = ModelRunner(self.vllm_config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget, capped at what max_num_seqs could ever use."""
        cc = self.vllm_config.cache_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cc.gpu_memory_utilization) - used
        else:
            gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", _CPU_KV_DEFAULT_GIB))
            budget = int(gib * (1 << 30))
        if per_block == 0:
            return self.model_runner.max_useful_blocks()
        n = min(budget // per_block, self.model_runner.max_useful_blocks())
        if n <= 0:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) does not hold one block of "
                f"{per_block} bytes; raise kv_cache_memory_bytes / gpu_memory_utilization"
            )
        return int(n)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, so: SchedulerOutput, intermediate_tensors=None):
        return self.model_runner.execute_model(so, intermediate_tensors)

    def check_health(self) -> bool:
        return True


