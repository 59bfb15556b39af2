# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculative decoding on the model runner's last stage: pick the speculator for the config."""

from __future__ import annotations

import torch

from vllm.config import VllmConfig
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator


def init_speculator(vllm_config: VllmConfig, device: torch.device | str) -> BaseSpeculator:
    spec = vllm_config.speculative_config
    if spec is None:
        raise ValueError("init_speculator needs a speculative_config")
    if spec.method == "mtp":
        from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

        return MTPSpeculator(vllm_config, device)
    if spec.method in ("dflash", "dspark"):
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

        return DFlashSpeculator(vllm_config, device)
    if spec.use_eagle:
        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

        return EagleSpeculator(vllm_config, device)
    raise NotImplementedError(f"{spec.method} is not supported yet.")
