# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculative decoding on the model runner's last stage: pick the speculator for the config."""

from __future__ import annotations

import importlib

import torch

from vllm.config import VllmConfig
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator


def init_speculator(vllm_config: VllmConfig, device: torch.device | str) -> BaseSpeculator:
    """The speculator the method's registry entry (vllm.config.SPEC_METHODS) names."""
    spec = vllm_config.speculative_config
    if spec is None:
        raise ValueError("init_speculator needs a speculative_config")
    if spec.hybrid_method is not None:
        from vllm.v1.worker.gpu.spec_decode.hybrid import HybridSpeculator

        return HybridSpeculator(vllm_config, device)
    module, name = spec.method_info.speculator.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(vllm_config, device)
