# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE3 heads in both public layouts against speculators' own Eagle3DraftModel.

The heads are random, built and saved by the speculators library itself (and re-written in the
legacy `midlayer.*` layout). The engine drafts for real requests; for every proposal we record
the context and the draft logits of each step, and speculators' forward - over HF
transformers' aux hidden states of that context - must produce the same logits:
step 0 over the target's taps, and steps 1..K-1 feeding back the draft's own hidden state and
the tokens it just drafted (the convention vLLM serves and speculators trains with its
training-time test: step k at the last position attends to the step-0 keys of every earlier
position and to its own steps 1..k there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.checkpoints import copy_checkpoint
from vllm.testing.engine_utils import make_prompts
from vllm.testing.speculators_heads import (
    SpeculatorsReference,
    make_speculators_eagle3,
    record_drafts,
    to_legacy_layout,
)

pytest.importorskip("speculators", reason="speculators is a test dependency (see README)")

COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _runner(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner


HEADS = {
    # name: (layout, make_speculators_eagle3 kwargs)
    "own-embed": ("speculators", dict(own_embed=True, norm_before_residual=True)),
    "shared-embed-d2t": (
        "speculators",
        dict(own_embed=False, norm_before_residual=False, draft_vocab_size=200),
    ),
    "norm-before-fc-norm-output-2-layers": (
        "speculators",
        dict(norm_before_fc=True, norm_output=True, num_layers=2, norm_before_residual=True),
    ),
    "fc-norm-d2t": ("speculators", dict(fc_norm=True, draft_vocab_size=300, own_embed=False)),
    "legacy-own-embed": ("legacy", dict(own_embed=True, norm_before_residual=True)),
    "legacy-shared-embed-d2t": ("legacy", dict(own_embed=False, draft_vocab_size=200)),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_draft_logits_match_speculators(name, llama_dir, tmp_path):
    layout, kw = HEADS[name]
    k = 3
    head = make_speculators_eagle3(tmp_path / "spec", llama_dir, aux_layers=(1, 2, 4), seed=7, **kw)
    ref = SpeculatorsReference(head, llama_dir)
    if layout == "legacy":
        head = to_legacy_layout(head, tmp_path / "legacy")
        assert "midlayer.self_attn.q_proj.weight" in _keys(head)
    llm = LLM(
        model=llama_dir,
        **COMMON,
        speculative_config={
            "method": "eagle3",
            "model": head,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
    )
    try:
        records = record_drafts(llm)
        prompts = make_prompts(512, [9, 17, 5], seed=3)
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(records) >= 6
    # The first proposal of each request, and a later one (its draft KV then spans steps).
    for context, drafts, rows in records[:3] + records[-3:]:
        ref_drafts, ref_rows = ref.drafts(context, k)
        for step, (ours, theirs) in enumerate(zip(rows, ref_rows)):
            torch.testing.assert_close(
                ours,
                theirs,
                rtol=1e-4,
                atol=1e-4,
                msg=lambda m, s=step: f"{name}: draft step {s}: {m}",
            )
        assert drafts == ref_drafts


def _keys(folder: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_speculators_head_infers_method_and_k(llama_dir, tmp_path):
    head = make_speculators_eagle3(tmp_path / "h", llama_dir, speculative_tokens=2)
    llm = LLM(model=llama_dir, **COMMON, speculative_config={"model": head})
    try:
        spec = llm.llm_engine.vllm_config.speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("eagle3", 2)
        assert _runner(llm).model.model.aux_hidden_state_layers == (1, 2, 3)
    finally:
        llm.shutdown()


def _edited(head: str, dst: Path, **changes) -> str:
    """A copy of head with config.json fields set ("layer.X": transformer_layer_config's X)."""
    layer = json.loads((Path(head) / "config.json").read_text())["transformer_layer_config"]
    updates: dict = {}
    for key, value in changes.items():
        if key.startswith("layer."):
            layer[key[len("layer.") :]] = value
            updates["transformer_layer_config"] = layer
        else:
            updates[key] = value
    return copy_checkpoint(head, dst, updates)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"norm_after_everything": True}, "unknown speculators config field.*norm_after_every"),
        ({"norm_before_fc": True, "fc_norm": True}, "mutually exclusive"),
        ({"norm_output": "yes"}, "norm_output must be true or false"),
        ({"speculators_model_type": "medusa"}, "speculators_model_type 'medusa'"),
        ({"layer.model_type": "qwen3"}, "model_type 'qwen3' is not supported"),
        ({"eagle_aux_hidden_state_layer_ids": [1, "x"]}, "eagle_aux_hidden_state_layer_ids"),
        ({"draft_vocab_size": 100000}, "draft_vocab_size must be an integer"),
        ({"target_hidden_size": 32}, "hidden size 32"),
    ],
)
def test_bad_speculators_config_is_refused_by_name(llama_dir, tmp_path, changes, match):
    head = make_speculators_eagle3(tmp_path / "h", llama_dir)
    bad = _edited(head, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(model=llama_dir, **COMMON, speculative_config={"model": bad})


def test_method_contradicting_the_checkpoint_is_refused(llama_dir, tmp_path):
    head = make_speculators_eagle3(tmp_path / "h", llama_dir)
    with pytest.raises(ValueError, match="does not match"):
        LLM(model=llama_dir, **COMMON, speculative_config={"method": "mtp", "model": head})
