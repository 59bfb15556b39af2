# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tiny PEFT LoRA adapters for tests and benchmarks (random A and B, so an adapter changes
the output), and the HF transformers + PEFT greedy reference."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def _dense_mlp_targets() -> Iterator[None]:
    """PEFT on transformers v5 rewrites gate / up / down targets of MoE families (DeepSeek-V3)
    into its fused-expert parameters, dropping the dense layers' MLP; the engine refuses
    experts, so adapters here target the dense MLP as PEFT did before v5 (creation and
    reference alike)."""
    from peft.utils import transformers_weight_conversion as conv

    table = conv._MODEL_TO_CONVERSION_PATTERN
    saved = dict(table)
    for k in ("deepseek_v3", "deepseek_v2"):
        table.pop(k, None)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base_dir: str,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: list[str] | str | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    b_scale: float = 0.3,
    **extra: Any,
) -> str:
    """Write a PEFT LoRA adapter of the checkpoint in base_dir to out_dir (PEFT's own
    save_pretrained) with random lora_B (PEFT starts it at zero, a no-op adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules or ATTN_MLP,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **extra,
    )
    with _dense_mlp_targets():
        peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                scale = b_scale if "lora_B" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@functools.lru_cache(maxsize=8)
def _peft_model(base_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with _dense_mlp_targets():
        return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(base_dir: str, adapter_dir: str, prompt_ids: list[int], max_tokens: int):
    """HF transformers + PEFT greedy continuation (argmax loop with the KV cache)."""
    m = _peft_model(base_dir, adapter_dir)
    out: list[int] = []
    with torch.no_grad():
        res = m(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_tokens):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = m(
                input_ids=torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True
            )
    return out
