# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Build a model for this pipeline stage and load its weights from the checkpoint."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.model_executor.models.registry import resolve_model_cls

logger = init_logger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(
    vllm_config: VllmConfig,
    model_config: ModelConfig | None = None,
    device: torch.device | str = "cpu",
    architecture: str | None = None,
    load_weights: bool = True,
) -> nn.Module:
    """Instantiate the architecture named in the config on device and load its weights."""
    model_config = model_config or vllm_config.model_config
    device = torch.device(device)
    dtype = model_config.torch_dtype(device.type)
    cls = resolve_model_cls(architecture or model_config.architecture)
    with _default_dtype(dtype), device:
        model = cls(vllm_config=vllm_config, model_config=model_config, prefix="")
    if load_weights:
        with torch.no_grad():
            model.load_weights(safetensors_weights_iterator(model_config.model))
    logger.info(
        "loaded %s from %s (%s, %.1fM params on this stage)",
        cls.__name__,
        model_config.model,
        dtype,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model.eval()
