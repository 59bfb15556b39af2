# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Environment variables of the engine and the server, read in one place.

Each is read when accessed (`vllm.envs.VLLM_PP_STEP_TIMEOUT_S`), so a test or a launcher that
sets one before starting an engine is honoured; a malformed value raises ValueError naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any


def _positive_float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
        return value

    return read


# A step (or an idle liveness ping) that no pipeline stage answers within this many seconds
# means a stage hangs (stopped, deadlocked, wedged device): the engine then fails every request
# and stops all stages. 120 s is far above any legitimate step seen on CPU (a full 2048-token
# prefill of SmolLM2-135M on one core takes a few seconds; the first CUDA step's kernel compiles
# well under a minute) and below the 300 s collective timeout that would otherwise end the wait.
_DEFAULT_PP_STEP_TIMEOUT_S = 120.0
# A request-supplied chat template gets this long to render; real templates take milliseconds.
_DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 5.0


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name)
        return default if raw is None else raw.strip().lower() in ("1", "true", "yes", "on")

    return read


def _str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


_READERS: dict[str, Callable[[], Any]] = {
    # 0 forces the torch reference path instead of the C++ CPU kernels (csrc/cpu).
    "VLLM_CPU_KERNELS": _flag("VLLM_CPU_KERNELS", True),
    # Where the CPU kernels are built and cached (default ~/.cache/vllm/cpu_kernels).
    "VLLM_CPU_KERNELS_BUILD_DIR": _str("VLLM_CPU_KERNELS_BUILD_DIR"),
    "VLLM_PP_STEP_TIMEOUT_S": _positive_float("VLLM_PP_STEP_TIMEOUT_S", _DEFAULT_PP_STEP_TIMEOUT_S),
    "VLLM_CHAT_TEMPLATE_TIMEOUT_S": _positive_float(
        "VLLM_CHAT_TEMPLATE_TIMEOUT_S", _DEFAULT_CHAT_TEMPLATE_TIMEOUT_S
    ),
}

if TYPE_CHECKING:  # the names this module provides
    VLLM_CPU_KERNELS: bool
    VLLM_CPU_KERNELS_BUILD_DIR: str | None
    VLLM_PP_STEP_TIMEOUT_S: float
    VLLM_CHAT_TEMPLATE_TIMEOUT_S: float


def __getattr__(name: str) -> Any:
    reader = _READERS.get(name)
    if reader is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return reader()


def __dir__() -> list[str]:
    return sorted(_READERS)
