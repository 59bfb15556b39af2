# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Build a model for this pipeline stage and load its weights from the checkpoint."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import time

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.distributed.parallel_state import TPGroup
from vllm.logger import init_logger
from vllm.model_executor.build_context import BuildContext, building
from vllm.model_executor.layers.quantization import get_quant_methods, process_weights_after_loading
from vllm.model_executor.model_loader.weight_utils import (
    TrackedWeights,
    safetensors_mmap_iterator,
    safetensors_weights_iterator,
)
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


_RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextlib.contextmanager
def _no_random_init():
    """torch.nn.init's random initialisers as no-ops: every parameter of a model built to be
    loaded is overwritten by the strict loader (a missing one is an error), so drawing random
    values for them first (~0.5 s for a 135M model's embedding and LM head) is wasted."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def get_model(
    vllm_config: VllmConfig,
    model_config: ModelConfig | None = None,
    device: torch.device | str = "cpu",
    architecture: str | None = None,
    load_weights: bool = True,
    tp_group: TPGroup | None = None,
) -> nn.Module:
    """Instantiate the architecture named in the config on device and load its weights; its
    layers split over tp_group (None: the worker's TP group)."""
    model_config = model_config or vllm_config.model_config
    device = torch.device(device)
    dtype = model_config.torch_dtype(device.type)
    cls = resolve_model_cls(architecture or model_config.architecture)
    quant_config = model_config.get_quant_config()
    build_ctx = BuildContext(quant_config, get_quant_methods(quant_config), tp_group)
    t0 = time.perf_counter()
    no_init = _no_random_init() if load_weights else contextlib.nullcontext()
    with _default_dtype(dtype), device, building(build_ctx), no_init:
        model = cls(vllm_config=vllm_config, model_config=model_config, prefix="")
    stored = "weights"
    if load_weights:
        # With TP each rank copies out only its part of most tensors: read them through a
        # memory map, so only those parts' pages are read.
        tp = vllm_config.parallel_config.tensor_parallel_size
        iterate = safetensors_mmap_iterator if tp > 1 else safetensors_weights_iterator
        weights = TrackedWeights(iterate(model_config.model))
        with torch.no_grad():
            model.load_weights(weights)
            process_weights_after_loading(model)
        if quant_config is not None and device.type == "cpu":
            _release_freed_heap()
        if weights.loaded_tensors:
            stored = f"weights {_mib(weights.loaded_bytes)} as stored ->"
    quant = f", {model_config.quantization} checkpoint" if quant_config is not None else ""
    logger.info(
        "loaded %s from %s in %.2f s (%s%s, %.1fM params on this stage; %s %s in memory)",
        cls.__name__,
        model_config.model,
        time.perf_counter() - t0,
        dtype,
        quant,
        sum(p.numel() for p in model.parameters()) / 1e6,
        stored,
        _mib(parameter_bytes(model)),
    )
    return model.eval()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights (parameters, tied ones once) as they sit in memory."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _release_freed_heap() -> None:
    """Hand the heap pages freed by dequantizing at load (FP8 storage, float32 temporaries)
    back to the OS: glibc keeps them otherwise (measured: ~+25% resident on a bf16 model)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None  # not glibc
    if trim is not None:
        trim(0)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
