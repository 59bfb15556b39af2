# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny PEFT adapters (random lora_B) of the session's tiny checkpoints."""

from __future__ import annotations

import pytest

from vllm.testing.lora_adapters import make_peft_adapter


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tmp_path_factory) -> list[str]:
    """Three adapters of llama_dir: all projections r=8; attention only r=4; MLP only with
    rsLoRA r=16."""
    mk = tmp_path_factory.mktemp
    return [
        make_peft_adapter(llama_dir, mk("llama_a1"), r=8, seed=1),
        make_peft_adapter(
            llama_dir,
            mk("llama_a2"),
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            seed=2,
            b_scale=0.6,
        ),
        make_peft_adapter(
            llama_dir,
            mk("llama_a3"),
            r=16,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["gate_proj", "up_proj", "down_proj"],
            seed=3,
        ),
    ]
