# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Engine configuration: one dataclass per concern, each in its own module, validated on
construction; every name is importable from `vllm.config`."""

from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.device import DeviceConfig
from vllm.config.lora import LoRAConfig
from vllm.config.model import (
    DEFAULT_MODEL_DIR,
    LoadFormat,
    LogprobsMode,
    ModelConfig,
    default_model_path,
    get_text_config,
    load_hf_config,
)
from vllm.config.parallel import DataParallelBackend, DistributedExecutorBackend, ParallelConfig
from vllm.config.scheduler import SchedulerConfig, SchedulerPolicy
from vllm.config.spec_methods import (
    EAGLE1_DRAFT_ARCHITECTURES,
    EAGLE1_TARGET_ARCHITECTURES,
    MTP_DRAFT_ARCHITECTURES,
    SPEC_METHODS,
    SpecMethod,
    num_mtp_layers,
)
from vllm.config.speculative import SpeculativeConfig
from vllm.config.structured_outputs import StructuredOutputsConfig
from vllm.config.utils import get_attr_docs
from vllm.config.vllm import VllmConfig

__all__ = [
    "DEFAULT_MODEL_DIR",
    "LoadFormat",
    "LogprobsMode",
    "EAGLE1_DRAFT_ARCHITECTURES",
    "EAGLE1_TARGET_ARCHITECTURES",
    "MTP_DRAFT_ARCHITECTURES",
    "SPEC_METHODS",
    "CacheConfig",
    "CompilationConfig",
    "DataParallelBackend",
    "DeviceConfig",
    "DistributedExecutorBackend",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "StructuredOutputsConfig",
    "SchedulerPolicy",
    "SpecMethod",
    "SpeculativeConfig",
    "VllmConfig",
    "default_model_path",
    "get_attr_docs",
    "get_text_config",
    "load_hf_config",
    "num_mtp_layers",
]
