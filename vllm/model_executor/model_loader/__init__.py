# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Building a model and loading its weights (`loader.py`: get_model), checkpoint reading and the
load errors (`weight_utils.py`). The loader's names are exported lazily: the layers raise the load
errors, so importing weight_utils must not import the loader that builds those layers."""

from __future__ import annotations

from typing import Any

_LAZY = ("get_model", "parameter_bytes")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from vllm.model_executor.model_loader import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
