# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The EAGLE3 trainer's head (tools/train_eagle3_smollm2.py DraftHead) computes what
speculators' Eagle3DraftModel computes, for one decoder layer and for two: the same random
weights, read by the trainer under the names its export writes, give the same logits at every
training-time-test step (step 0 over the target's taps at every position, steps 1 and 2
feeding back the head's own hidden state with teacher-forced tokens), also when step 0's
output and the later steps run at a subset of the positions, as training runs them. What the trainer
optimises is then what the engine serves (the engine is held to speculators by
tests/v1/spec_decode/test_eagle3_speculators.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm.testing.speculators_heads import SpeculatorsReference, make_speculators_eagle3

pytest.importorskip("speculators", reason="speculators is a test dependency (see README)")

STEPS = 3  # the `tool` fixture (the trainer's module): conftest.py


def _trainer_head(tool, head_dir: str, target_dir: str, num_layers: int, embed: torch.Tensor):
    cfg = tool.head_config(json.loads((Path(target_dir) / "config.json").read_text()), num_layers)
    w = load_file(str(Path(head_dir) / "model.safetensors"))
    head = tool.DraftHead(cfg, embed, w["lm_head.weight"].float(), seed=0)
    # Every trained tensor is one the speculators format names, and every tensor of the
    # format but the frozen / mapping ones is trained.
    frozen = {"lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    assert set(head.params) == {k for k in w if k not in frozen and not k.startswith("verifier_")}
    with torch.no_grad():
        for k, v in head.params.items():
            assert v.shape == w[k].shape, k
            v.copy_(w[k].float())
    return head


@pytest.mark.parametrize("num_layers", [1, 2])
def test_trainer_head_matches_speculators(tool, llama_dir, tmp_path, num_layers):
    aux_layers = (1, 2, 3)
    head_dir = make_speculators_eagle3(
        tmp_path / "head",
        llama_dir,
        aux_layers=aux_layers,
        own_embed=False,
        draft_vocab_size=200,
        norm_before_residual=True,
        num_layers=num_layers,
        seed=3,
    )
    ref = SpeculatorsReference(head_dir, llama_dir)
    embed = ref.hf.model.embed_tokens.weight.detach().float()
    head = _trainer_head(tool, head_dir, llama_dir, num_layers, embed)

    g = torch.Generator().manual_seed(5)
    T = 14
    ids = torch.randint(3, embed.shape[0], (T + STEPS,), generator=g).tolist()
    aux = ref.aux_hidden_states(ids[:T])  # [T, 3H]
    next_ids = ids[1 : T + STEPS]  # the token after each position, then the continuation
    want = ref.step_logits(aux, next_ids, STEPS)

    valid = torch.ones(1, T, dtype=torch.bool)

    def at(lo: int):  # positions lo .. T - 1 of the one sequence
        return (torch.zeros(T - lo, dtype=torch.long), torch.arange(lo, T))

    # Every position, then (as training runs) step 0's output only where a loss reads it
    # and the later steps at a subset of those.
    for lo0, lo in ((0, 0), (3, 5)):
        with torch.no_grad():
            got = head.forward(
                aux[None], torch.tensor([next_ids]), valid, STEPS, rows=at(lo), rows0=at(lo0)
            )
        assert len(got) == STEPS
        torch.testing.assert_close(got[0], want[0][lo0:], rtol=1e-4, atol=1e-4)
        for k in range(1, STEPS):
            torch.testing.assert_close(got[k], want[k][lo:], rtol=1e-4, atol=1e-4)
    # A real check: the head's steps differ from each other and from a head missing a layer.
    assert not torch.allclose(want[1], want[0], atol=1e-2)
