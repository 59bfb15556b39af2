# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Weight quantization: the config parsed from a checkpoint's `quantization_config`, the
per-layer methods it hands out, and the construction context models are built under."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_local = threading.local()


class QuantizationConfig:
    """One quantization method's settings; hands a method object to each layer it quantizes."""

    name: str = ""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        raise NotImplementedError

    def get_linear_method(self):
        """The method a quantizable linear layer stores its weights and computes with."""
        raise NotImplementedError

    def get_moe_method(self):
        """The method stacked MoE experts store their weights and compute with."""
        raise NotImplementedError


def _registry() -> dict[str, type[QuantizationConfig]]:
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    return {"fp8": Fp8Config}


QUANTIZATION_METHODS = ("fp8",)


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The `quantization_config` dict of config.json (top level, or the text config of a
    multimodal checkpoint), or None for an unquantized checkpoint."""
    for cfg in (hf_config, getattr(hf_config, "get_text_config", lambda: None)()):
        qc = getattr(cfg, "quantization_config", None) if cfg is not None else None
        if qc is None:
            continue
        if hasattr(qc, "to_dict"):
            qc = qc.to_dict()
        if not isinstance(qc, dict):
            raise ValueError(
                f"config.json quantization_config must be an object, got {type(qc).__name__}"
            )
        return qc
    return None


def resolve_quantization(
    requested: str | None, hf_config: Any, model: str
) -> tuple[str | None, QuantizationConfig | None]:
    """(method name, parsed config) for a checkpoint; requested is the user's `quantization`
    (None: take the checkpoint's). Raises ValueError naming the field for anything we cannot
    run: an unknown method, a mismatch with the checkpoint, or bad quantization_config fields."""
    if requested is not None and (
        not isinstance(requested, str) or requested not in QUANTIZATION_METHODS
    ):
        raise ValueError(
            f"quantization {requested!r} is not supported; supported: {list(QUANTIZATION_METHODS)}"
        )
    qc = checkpoint_quantization_config(hf_config)
    if qc is None:
        if requested is not None:
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized ahead of time, but "
                f"config.json of {model!r} has no quantization_config (quantizing unquantized "
                "weights at load is not supported)"
            )
        return None, None
    method = qc.get("quant_method")
    if not isinstance(method, str) or method.lower() not in QUANTIZATION_METHODS:
        raise ValueError(
            f"config.json of {model!r}: quantization_config.quant_method {method!r} is not "
            f"supported; supported: {list(QUANTIZATION_METHODS)}"
        )
    method = method.lower()
    if requested is not None and requested != method:
        raise ValueError(
            f"quantization={requested!r} does not match the checkpoint's quantization_config."
            f"quant_method {method!r} ({model!r})"
        )
    return method, _registry()[method].from_config(qc)


@contextmanager
def set_quant_config(config: QuantizationConfig | None) -> Iterator[None]:
    """Build models under config: quantizable layers created inside take their method from it
    (the way torch's default dtype and device contexts shape the parameters they create)."""
    prev = getattr(_local, "config", None)
    _local.config = config
    try:
        yield
    finally:
        _local.config = prev


def get_current_quant_config() -> QuantizationConfig | None:
    """The config of the model being built (None outside set_quant_config: unquantized)."""
    return getattr(_local, "config", None)


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
