# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""A compact inference engine with vLLM's public surface."""

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.llm import LLM
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.version import __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestOutputKind",
    "EngineArgs",
    "__version__",
]
