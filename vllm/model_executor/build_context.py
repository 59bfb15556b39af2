# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What a model is built under: its quantization (the layer methods it hands out) and the tensor-
parallel group its layers split over, in one object. The loader sets it around a model's
construction (`building(ctx)`); each layer reads it in `__init__` and keeps what it needs
(`self.tp`, `self.quant_method`), so a forward looks nothing up."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from vllm.config.quantization import QuantizationConfig
from vllm.distributed.parallel_state import TPGroup, get_tp_group


class QuantMethods(Protocol):
    """A quantization's per-layer methods (model_executor/layers/quantization builds one)."""

    def linear(self) -> Any:
        """The method a quantizable linear layer stores its weights and computes with."""

    def moe(self) -> Any:
        """The method stacked MoE experts store their weights and compute with."""


@dataclass(frozen=True)
class BuildContext:
    quant_config: QuantizationConfig | None = None
    """The checkpoint's quantization (None: unquantized)."""
    quant_methods: QuantMethods | None = None
    """The layer methods for quant_config (None when unquantized)."""
    tp_group: TPGroup | None = None
    """The group the layers split over; None: the worker's (a draft at
    draft_tensor_parallel_size=1 is built under the trivial TPGroup(): whole on every rank)."""

    @property
    def tp(self) -> TPGroup:
        return self.tp_group if self.tp_group is not None else get_tp_group()


_BUILD: ContextVar[BuildContext | None] = ContextVar("vllm_build_context", default=None)


@contextmanager
def building(ctx: BuildContext) -> Iterator[BuildContext]:
    """Construct modules under ctx (as torch's default dtype / device contexts shape the
    parameters created inside). Construction only: forwards never read it."""
    token = _BUILD.set(ctx)
    try:
        yield ctx
    finally:
        _BUILD.reset(token)


def current_build_context() -> BuildContext:
    """The context of the model being built; outside `building`, an unquantized build over the
    worker's TP group (layers made directly, as tests do)."""
    ctx = _BUILD.get()
    return ctx if ctx is not None else BuildContext()
