# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""A compact inference engine with vLLM's public surface. `LLM` is exported lazily (as upstream
vLLM does), so `import vllm` does not import the entrypoints and the engine behind them."""

from typing import TYPE_CHECKING, Any

from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.version import __version__

if TYPE_CHECKING:
    from vllm.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestOutputKind",
    "EngineArgs",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from vllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
