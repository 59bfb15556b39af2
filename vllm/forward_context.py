# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The per-forward attention metadata, set by the runner around each model call."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_local = threading.local()


@dataclass
class ForwardContext:
    attn_metadata: Any
    """Metadata every attention layer of this forward reads (slot mapping, sequence layout)."""
    linear_attn_metadata: Any = None
    """Hybrid models: what their linear-attention (state) layers read (state slot per request,
    whether it has a prior state, query_start_loc); None for models without such layers."""


@contextmanager
def set_forward_context(
    attn_metadata: Any, linear_attn_metadata: Any = None
) -> Iterator[ForwardContext]:
    """Make attn_metadata visible to the attention layers for the duration of one forward."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ForwardContext(attn_metadata, linear_attn_metadata)
    try:
        yield _local.ctx
    finally:
        _local.ctx = prev


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return ctx
