# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Model capability interfaces (pipeline parallelism, EAGLE3 aux hidden states)."""

from __future__ import annotations

import inspect
from typing import ClassVar, Protocol, runtime_checkable

import torch

from vllm.sequence import IntermediateTensors


@runtime_checkable
class SupportsPP(Protocol):
    """A model that can be split into pipeline stages."""

    supports_pp: ClassVar[bool] = True

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors: ...


def supports_pp(model: object) -> bool:
    cls = model if isinstance(model, type) else type(model)
    if not getattr(cls, "supports_pp", False):
        return False
    if not callable(getattr(cls, "make_empty_intermediate_tensors", None)):
        return False
    return "intermediate_tensors" in inspect.signature(cls.forward).parameters
