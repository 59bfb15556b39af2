# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Weight quantization's layer methods: the methods a parsed config (vllm.config.quantization)
hands the layers built under it, and the conversion after loading. The config classes themselves
are re-exported here for callers that look for them in vLLM's place."""

from __future__ import annotations

from torch import nn

from vllm.config.quantization import (
    QUANTIZATION_METHODS,
    Fp8Config,
    QuantizationConfig,
    checkpoint_quantization_config,
    resolve_quantization,
)
from vllm.model_executor.build_context import QuantMethods
from vllm.model_executor.layers.quantization.fp8 import Fp8Methods

__all__ = [
    "QUANTIZATION_METHODS",
    "Fp8Config",
    "QuantizationConfig",
    "QuantMethods",
    "checkpoint_quantization_config",
    "get_quant_methods",
    "process_weights_after_loading",
    "resolve_quantization",
]


def get_quant_methods(config: QuantizationConfig | None) -> QuantMethods | None:
    """The layer methods of config (None: unquantized)."""
    if config is None:
        return None
    if isinstance(config, Fp8Config):
        return Fp8Methods(config)
    raise ValueError(f"no layer methods for quantization {config.name!r}")


def process_weights_after_loading(model: nn.Module) -> None:
    """Once every weight is loaded: let each layer's method convert its weights for compute
    (dequantize, re-layout scales), then modules that derive state from their weights (MLA's
    absorbed kv_b_proj) do so from the final form."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()
