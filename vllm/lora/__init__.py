# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Multi-LoRA serving: PEFT adapters applied per row of a batch (vLLM's `enable_lora`)."""
