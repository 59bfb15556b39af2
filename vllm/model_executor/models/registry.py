# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Architecture name (config.architectures[0]) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("vllm.model_executor.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM"),
    "DeepseekV2ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    # Qwen3.5 hybrids; the multimodal checkpoints with their vision tower.
    "Qwen3_5ForCausalLM": ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": (
        "vllm.model_executor.models.qwen3_5_vl",
        "Qwen3_5ForConditionalGeneration",
    ),
    "Qwen3_5MoeForCausalLM": ("vllm.model_executor.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": (
        "vllm.model_executor.models.qwen3_5_vl",
        "Qwen3_5MoeForConditionalGeneration",
    ),
    "DeepseekV32ForCausalLM": ("vllm.models.deepseek_v32.model", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("vllm.models.deepseek_v32.model", "GlmMoeDsaForCausalLM"),
    # Speculative-decoding drafts.
    "DeepSeekMTPModel": ("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP"),
    "DeepseekV32MTP": ("vllm.models.deepseek_v32.mtp", "DeepseekV32MTP"),
    "Qwen3_5MTP": ("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MTP"),
    "Qwen3_5MoeMTP": ("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MoeMTP"),
    "EagleLlamaForCausalLM": ("vllm.model_executor.models.llama_eagle", "EagleLlamaForCausalLM"),
    "LlamaForCausalLMEagle3": ("vllm.model_executor.models.llama_eagle3", "LlamaForCausalLMEagle3"),
    "Eagle3LlamaForCausalLM": ("vllm.model_executor.models.llama_eagle3", "LlamaForCausalLMEagle3"),
    "DFlashDraftModel": ("vllm.model_executor.models.dflash", "DFlashDraftModel"),
    "DSparkDraftModel": ("vllm.model_executor.models.dflash", "DSparkDraftModel"),
}


def register_model(arch: str, module: str, cls_name: str) -> None:
    _MODELS[arch] = (module, cls_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_cls(arch: str) -> type:
    if arch not in _MODELS:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {supported_architectures()}"
        )
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(module), name)
