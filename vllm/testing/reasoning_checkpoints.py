# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""A tiny Llama that thinks: its tokenizer has <think> and </think> as single added tokens
(not special, so they stay in the text, as Qwen3's and DeepSeek-R1's), a chat template with
Qwen3's `enable_thinking` and DeepSeek-V3.1's `thinking` switches, and an LM head that emits
</think> a few tokens into the greedy answer of a given conversation (its row is a scaled copy
of the row of the token greedy decoding would pick there), so the answer has reasoning, the
end marker and content after it."""

from __future__ import annotations

import os

import torch

from vllm.testing.checkpoints import make_llama
from vllm.testing.hf_init import _save_model

THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if thinking is defined and thinking %}{{ '<think>\\n' }}"
    "{% elif thinking is defined %}{{ '</think>' }}"
    "{% elif enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)


@torch.no_grad()
def make_thinking_llama(
    out_dir: str | os.PathLike, conversation: list[dict[str, str]], end_step: int = 4
) -> str:
    """Write the checkpoint; greedy decoding of `conversation` (default template kwargs)
    emits </think> at step `end_step` or earlier (never first)."""
    import transformers
    from tokenizers import AddedToken

    make_llama(out_dir)
    tok = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(str(out_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    end_id = tok.convert_tokens_to_ids("</think>")
    start_id = tok.convert_tokens_to_ids("<think>")
    head = model.get_output_embeddings().weight
    head[start_id] = -head[start_id].abs()  # never emitted
    head[end_id] = 0.0
    prompt = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    for step in range(end_step, 0, -1):
        out = model.generate(ids, max_new_tokens=step + 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        logits = out.logits[step][0]
        pick = int(logits.argmax())
        if float(logits[pick]) > 0:
            head[end_id] = head[pick] * 1.5  # wins wherever `pick` would have been chosen
            break
    else:
        raise RuntimeError("no positive greedy logit to copy for </think>")
    _save_model(model, out_dir, torch.float32)
    return str(out_dir)
