# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Which engine a configuration runs: one in-process LLMEngine, or the data-parallel front end
over replica engines. Apart from both so that neither imports the other (a replica runs an
LLMEngine)."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.engine.engine_inputs import EngineInputs


def create_engine(vllm_config: VllmConfig) -> EngineInputs:
    """The engine a configuration asks for (both have the EngineInputs interface)."""
    if vllm_config.parallel_config.uses_dp_front_end:
        from vllm.v1.engine.dp_engine import DPEngine

        return DPEngine(vllm_config)
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine(vllm_config)
