# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""A bf16 EAGLE3 head under an fp32 target on CPU keeps its linear weights in bf16 (half the
bytes every draft pass reads) and drafts exactly what the same head widened to fp32 drafts:
the same draft tokens at every step, the same text as no speculation."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.model_executor.models.llama_eagle3 import LlamaForCausalLMEagle3
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import make_eagle3_draft

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPEC = {"num_speculative_tokens": 3, "adaptive_num_speculative_tokens": False}


@pytest.fixture(scope="module")
def bf16_head(llama_dir, tmp_path_factory) -> str:
    """A random EAGLE3 head stored in bf16 (its floating-point tensors; d2t stays int64)."""
    src = Path(make_eagle3_draft(tmp_path_factory.mktemp("e3_src"), llama_dir))
    out = tmp_path_factory.mktemp("e3_bf16")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    w = load_file(src / "model.safetensors")
    narrow = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}
    save_file(narrow, out / "model.safetensors", {"format": "pt"})
    return str(out)


def _run(target: str, head: str | None, prompts):
    spec = None if head is None else {"method": "eagle3", "model": head, **SPEC}
    llm = LLM(
        model=target, dtype="float32", max_model_len=256, max_num_seqs=4, speculative_config=spec
    )
    drafts: list[np.ndarray] = []
    dtypes: dict[str, torch.dtype] = {}
    try:
        if head is not None:
            spec_obj = llm.llm_engine.executor.worker.model_runner.speculator
            dtypes = {n: p.dtype for n, p in spec_obj.draft.named_parameters()}
            propose = spec_obj.propose

            def recording(*a, **kw):
                out = propose(*a, **kw)
                drafts.append(np.array(out, copy=True))
                return out

            spec_obj.propose = recording
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], drafts, dtypes
    finally:
        llm.shutdown()


def test_bf16_head_drafts_exactly_as_widened(llama_dir, bf16_head, monkeypatch):
    prompts = make_prompts(512, [30, 7, 19, 44], seed=2)
    ref, _, _ = _run(llama_dir, None, prompts)
    text, drafts, dtypes = _run(llama_dir, bf16_head, prompts)
    linear = [n for n in dtypes if n.endswith(("proj.weight", "fc.weight", "lm_head.weight"))]
    assert len(linear) == 6 and all(dtypes[n] == torch.bfloat16 for n in linear), dtypes
    assert dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
    monkeypatch.setattr(LlamaForCausalLMEagle3, "keeps_exact_bf16_weights", False)
    wide_text, wide_drafts, wide_dtypes = _run(llama_dir, bf16_head, prompts)
    assert all(wide_dtypes[n] == torch.float32 for n in linear)
    assert text == wide_text == ref
    assert len(drafts) == len(wide_drafts) > 0
    for step, (a, b) in enumerate(zip(drafts, wide_drafts)):
        assert np.array_equal(a, b), f"step {step}: {a} != {b}"
