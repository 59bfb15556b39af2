# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Qwen2: the Llama architecture with biases on the q/k/v projections."""

from __future__ import annotations

from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel


class Qwen2Model(LlamaModel):
    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
