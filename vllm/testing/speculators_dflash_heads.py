# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DFlash / DSpark heads built and run by the `speculators` library (the test reference).

- make_speculators_dflash(...): a random head for a target folder, constructed with
  speculators' own DFlash / DSpark config and model classes and written by its
  save_pretrained, so the folder is exactly what speculators publishes.
- make_bigram_head(...): a constructed head whose blocks are known without running it (identity
  draft layers, the target's embedding and LM head; DSpark: a Markov head that adds
  BIAS * onehot(b(prev))), for targets whose greedy next token is mostly a function b of the
  current one (tests/spec_checkpoints.py:make_llama_bigram_target).
- DFlashReference: speculators' anchored-block forward (`_backbone_forward`, eager attention,
  fp32) over HF transformers' aux hidden states, with a single anchor at the end of a context;
  DSpark's Markov bias and confidence head applied by speculators' own modules to the block's
  teacher-forced previous tokens (the tokens the engine drafted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm.testing.speculators_heads import (
    SpeculatorsReference,
    load_random_vocab_mapping,
    read_target_config,
    target_layer_fields,
)

MASK = 3  # the constructed heads' mask token
BIAS = 100.0  # the constructed DSpark head's Markov logit bias


def make_speculators_dflash(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    dspark: bool = False,
    aux_layers: tuple[int, ...] = (1, 2, 3),
    block_size: int = 4,
    sample_from_anchor: bool | None = None,
    mask_token_id: int = 3,
    draft_vocab_size: int | None = None,
    num_layers: int = 1,
    markov_rank: int = 16,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
    speculative_tokens: int | None = None,
    seed: int = 0,
    init: str = "random",
) -> str:
    """init="random": random weights (logit scale large enough that argmaxes are decisive);
    init="zero": every weight zero and norms one (callers then set what they need)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    t = read_target_config(target_dir)
    layer = Qwen3Config(
        **target_layer_fields(t),
        head_dim=int(t["hidden_size"]) // int(t["num_attention_heads"]),
        num_hidden_layers=num_layers,
    )
    vocab = int(t["vocab_size"])
    dv = int(draft_vocab_size or vocab)
    if sample_from_anchor is None:
        sample_from_anchor = dspark
    k = speculative_tokens or (block_size if sample_from_anchor else block_size - 1)
    common: dict[str, Any] = dict(
        transformer_layer_config=layer,
        draft_vocab_size=dv,
        block_size=block_size,
        aux_hidden_state_layer_ids=list(aux_layers),
        mask_token_id=mask_token_id,
        sample_from_anchor=sample_from_anchor,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark" if dspark else "dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(target_dir), architectures=t.get("architectures")
            ),
        ),
    )
    if dspark:
        cfg = DSparkSpeculatorConfig(
            **common,
            markov_rank=markov_rank,
            markov_head_type=markov_head_type,
            enable_confidence_head=enable_confidence_head,
            confidence_head_with_markov=confidence_head_with_markov,
        )
        model = DSparkDraftModel(cfg)
    else:
        model = DFlashDraftModel(DFlashSpeculatorConfig(**common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_") or name == "embed_tokens.weight":
                continue
            if init == "zero":
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p))
            elif p.dim() == 2:
                gain = 4.0 if name in ("lm_head.weight", "markov_head.markov_w2.weight") else 1.0
                fan_in = 1 if name == "markov_head.markov_w1.weight" else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=gen) * gain / fan_in**0.5)
            elif name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        if dv < vocab:
            load_random_vocab_mapping(model, vocab, dv, gen)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def _weights(folder: str | Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def bigram_map(target_dir: str) -> torch.Tensor:
    """b[t] = argmax lm_head(rmsnorm(embed[t])): the token an identity draft layer stack
    predicts from token t (the target's final norm weight is one)."""
    w = _weights(target_dir)
    eps = json.loads((Path(target_dir) / "config.json").read_text())["rms_norm_eps"]
    e = w["model.embed_tokens.weight"].double()
    e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).double()
    return (e @ head.T).argmax(-1)


def make_bigram_head(out_dir: Path, target_dir: str, dspark: bool, k: int) -> str:
    vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    head = make_speculators_dflash(
        out_dir,
        target_dir,
        dspark=dspark,
        block_size=k,
        sample_from_anchor=True,
        mask_token_id=MASK,
        markov_rank=vocab,
        enable_confidence_head=dspark,
        init="zero",
    )
    if dspark:
        b = bigram_map(target_dir)
        path = Path(head) / "model.safetensors"
        w = _weights(head)
        w["markov_head.markov_w1.weight"] = torch.eye(vocab)
        w2 = torch.zeros(vocab, vocab)
        w2[b, torch.arange(vocab)] = BIAS
        w["markov_head.markov_w2.weight"] = w2
        save_file(w, str(path), {"format": "pt"})
    return head


class DFlashReference:
    """speculators' DFlash / DSpark block forward (eager attention, fp32) over HF's taps."""

    def __init__(self, head_dir: str | os.PathLike, target_dir: str | os.PathLike) -> None:
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

        raw = json.loads((Path(head_dir) / "config.json").read_text())
        self.dspark = raw["speculators_model_type"] == "dspark"
        cfg_cls, model_cls = (
            (DSparkSpeculatorConfig, DSparkDraftModel)
            if self.dspark
            else (DFlashSpeculatorConfig, DFlashDraftModel)
        )
        cfg = cfg_cls.from_pretrained(str(head_dir))
        cfg.speculators_config.verifier.name_or_path = str(target_dir)
        cfg.transformer_layer_config._attn_implementation = "eager"
        self.model = model_cls.from_pretrained(str(head_dir), config=cfg).float().eval()
        # The HF target gives the aux taps; the head shares the verifier's embedding (and,
        # over the full vocabulary, its LM head): copy them explicitly from the local target.
        taps = SpeculatorsReference.__new__(SpeculatorsReference)
        from transformers import AutoModelForCausalLM

        taps.hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        taps.taps = list(cfg.aux_hidden_state_layer_ids)
        self.taps = taps
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(taps.hf.model.embed_tokens.weight)
            if not self.model.use_draft_vocab:
                self.model.lm_head.weight.copy_(taps.hf.lm_head.weight)
        self.block_size = int(cfg.block_size)
        self.sample_from_anchor = bool(cfg.sample_from_anchor)
        dv = self.model.draft_vocab_size
        d2t = self.model.d2t if self.model.d2t is not None else torch.zeros(dv, dtype=torch.long)
        self.draft_to_target = torch.arange(dv) + d2t

    @torch.no_grad()
    def block_logits(self, context: list[int], drafts: list[int]) -> torch.Tensor:
        """Draft-vocab logits [block_size, Vd] of the block anchored at the last token of
        context (positions before it are the context); drafts are the tokens the block's
        slots drafted, in order (DSpark's Markov head reads them as previous tokens)."""
        m, B = self.model, self.block_size
        a = len(context) - 1
        block = [context[-1]] + [0] * (B - 1)
        # Slot s's previous token (DSpark) is block[s]: the anchor, then the drafts.
        for i, d in enumerate(drafts[: B - 1]):
            block[1 + i] = d  # the token at a + 1 + i
        ids = list(context) + block[1:] + [0]  # room: anchors exclude the last block_size
        n = len(ids)
        aux = self.taps.aux_hidden_states(ids)
        loss_mask = torch.zeros(1, n, dtype=torch.long)
        loss_mask[0, a] = 1
        hidden, logits, *_ = m._backbone_forward(
            aux[None],
            torch.tensor([ids]),
            loss_mask,
            torch.zeros(1, n, m.config.transformer_layer_config.hidden_size),
            torch.zeros(1, n, dtype=torch.long),
            max_anchors=1,
        )
        logits = logits[0].float()
        if self.dspark:
            prev = torch.tensor([ids[a : a + B]])
            if not self.sample_from_anchor:
                prev = torch.cat([prev[:, :1], prev[:, :-1]], dim=1)
            self.prev = prev
            if m.markov_head is not None:
                bias = m.markov_head.block_bias(
                    prev_token_ids=prev, hidden_states=hidden.view(1, B, -1)
                )
                logits = logits + bias[0].float()
            self.confidence = None
            if m.confidence_head is not None:
                feats = hidden.view(1, B, -1)
                if m.config.confidence_head_with_markov:
                    feats = torch.cat([feats, m.markov_head.prev_embeddings(prev)], dim=-1)
                self.confidence = torch.sigmoid(m.confidence_head(feats)[0])
        return logits
