# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DraftModel.bind_target: what a draft takes from its target once both are loaded (a missing
embedding / LM head becomes the target's, an identical one is aliased, a different one kept,
none on the stage is an error), bound once; whether its first pass gathers the target's encoder
outputs (only a draft taking them, on the stage holding them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.distributed.parallel_state import PPGroup, get_pp_group, set_pp_group
from vllm.model_executor.models.draft import DraftModel
from vllm.model_executor.models.interfaces import TargetShares

H, V = 8, 32
CFG = SimpleNamespace(hidden_size=H, vocab_size=V)


class _Draft(DraftModel):
    """The smallest DraftModel: an embedding and an LM head, own or not."""

    def __init__(self, own_embed: bool = True, own_head: bool = True, vocab: int = V) -> None:
        self.vocab = vocab
        super().__init__(SimpleNamespace(), SimpleNamespace(hf_text_config=CFG))
        self.has_own_embed_tokens = own_embed
        self.has_own_lm_head = own_head

    def build_model(self, vllm_config, model_config, prefix) -> nn.Module:
        model = nn.Module()
        model.embed_tokens = nn.Embedding(self.vocab, H)
        self.lm_head = nn.Linear(H, self.vocab, bias=False)
        return model


class _MMDraft(_Draft):
    supports_mm_inputs = True


def _shares(**kw) -> TargetShares:
    return TargetShares(
        hidden_size=H,
        embed_tokens=kw.pop("embed_tokens", nn.Embedding(V, H)),
        lm_head=kw.pop("lm_head", nn.Linear(H, V, bias=False)),
        **kw,
    )


def test_missing_modules_become_the_targets():
    draft, shares = _Draft(own_embed=False, own_head=False), _shares()
    draft.bind_target(shares)
    assert draft.model.embed_tokens is shares.embed_tokens
    assert draft.lm_head is shares.lm_head
    assert draft.bound_shares is shares


def test_own_modules_are_kept_unless_equal_to_the_targets():
    shares = _shares()
    draft = _Draft()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(shares.embed_tokens.weight)  # an identical copy
    own_head = draft.lm_head
    draft.bind_target(shares)
    assert draft.model.embed_tokens is shares.embed_tokens  # one copy in memory
    assert draft.lm_head is own_head  # its own values: kept


def test_nothing_to_embed_with_on_this_stage_is_an_error():
    with pytest.raises(RuntimeError, match="nothing to embed its proposals with"):
        _Draft(own_embed=False).bind_target(_shares(embed_tokens=None))
    with pytest.raises(RuntimeError, match="ships no lm_head and the target has none"):
        _Draft(own_head=False).bind_target(_shares(lm_head=None))
    # A draft with its own keeps working where the target holds neither.
    _Draft().bind_target(_shares(embed_tokens=None, lm_head=None))


def test_a_missing_module_of_another_shape_cannot_be_shared():
    with pytest.raises(RuntimeError, match="cannot share the target's"):
        _Draft(own_embed=False, vocab=V + 1).bind_target(_shares())


def test_bound_once():
    draft = _Draft()
    draft.bind_target(_shares())
    with pytest.raises(RuntimeError, match="already bound"):
        draft.bind_target(_shares())


@pytest.mark.parametrize("draft_cls", [_Draft, _MMDraft])
@pytest.mark.parametrize("has_encoder_outputs", [False, True])
def test_binding_decides_the_mm_gather(draft_cls, has_encoder_outputs):
    draft = draft_cls()
    draft.bind_target(_shares(has_encoder_outputs=has_encoder_outputs))
    assert draft.gather_mm_embeds is (draft_cls.supports_mm_inputs and has_encoder_outputs)


@pytest.mark.parametrize("multimodal", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_target_offers_encoder_outputs_only_on_its_first_stage(
    llama_dir, monkeypatch, multimodal, rank
):
    """The encoder runs with the embedding, on the first stage: the last of two stages (where
    the draft lives) has no encoder outputs to offer, and a text-only target has none."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_multimodal", multimodal)
    config = EngineArgs(
        model=llama_dir, dtype="float32", max_model_len=64, pipeline_parallel_size=2
    ).create_engine_config()
    old = get_pp_group()
    set_pp_group(PPGroup(rank=rank, world_size=2))
    try:
        shares = get_model(config, load_weights=False).draft_shares()
    finally:
        set_pp_group(old)
    assert shares.has_encoder_outputs is (multimodal and rank == 0)
    assert (shares.lm_head is None) is (rank == 0)


def test_text_only_speculators_skip_the_mm_gather(deepseek_v3_mtp1_dir):
    from vllm import LLM

    llm = LLM(
        model=deepseek_v3_mtp1_dir,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 1,
        },
    )
    try:
        draft = llm.llm_engine.executor.worker.model_runner.speculator.model
        assert draft.bound_shares is not None and draft.gather_mm_embeds is False
    finally:
        llm.shutdown()


def test_fc_reads_as_many_taps_as_the_target_returns():
    from vllm.model_executor.models.draft import check_combined_taps

    fc = nn.Linear(3 * H, H, bias=False)
    check_combined_taps(_Draft(), fc, _shares(aux_hidden_state_layers=(1, 2, 3)))
    with pytest.raises(ValueError, match=f"expects {3 * H}"):
        check_combined_taps(_Draft(), fc, _shares(aux_hidden_state_layers=(1, 2)))
