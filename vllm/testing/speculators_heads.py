# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE3 heads built and run by the `speculators` library (the test reference for drafts).

- make_speculators_eagle3(...): a random head for a target folder, constructed with speculators'
  own `Eagle3SpeculatorConfig` / `Eagle3DraftModel` and written by its `save_pretrained`, so the
  folder is exactly what speculators publishes (optionally without embed_tokens).
- to_legacy_layout(...): the same weights in the legacy `LlamaForCausalLMEagle3` layout
  (`midlayer.*`, switches at the top level, taps in `eagle_config`).
- SpeculatorsReference: speculators' `Eagle3DraftModel.forward` over HF transformers' aux hidden
  states, returning the logits of every training-time-test step.
- record_drafts(llm): what the engine's EAGLE3 speculator proposes, observed (context, drafts and
  draft-vocabulary logits of each step of every proposal).

Step k of speculators' forward at index t reads the teacher-forced token ids[t + 1 + k] and its
own step k - 1 output hidden at t, attending to step-0 keys at indices <= t and to its own
earlier steps at t. With the engine's draft tokens appended after the context, step k at the
last context index is exactly what the engine's draft step k computes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_target_config(target_dir: str | os.PathLike) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


# The target's fields a draft head's decoder layer copies.
_LAYER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
)


def target_layer_fields(target: dict) -> dict:
    """The decoder-layer fields of a target config.json that a draft head's layer copies."""
    return {k: target[k] for k in _LAYER_KEYS if k in target}


def load_random_vocab_mapping(
    model: torch.nn.Module, vocab: int, dv: int, gen: torch.Generator
) -> None:
    """A random sorted draft vocabulary of dv of the target's vocab ids, loaded as the head's
    d2t / t2d buffers (speculators' load_vocab_mappings)."""
    ids = torch.randperm(vocab, generator=gen)[:dv].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(dv))


def make_speculators_eagle3(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    aux_layers: tuple[int, ...] = (1, 2, 3),
    own_embed: bool = True,
    draft_vocab_size: int | None = None,
    norm_before_residual: bool = False,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool = False,
    num_layers: int = 1,
    speculative_tokens: int = 3,
    seed: int = 0,
) -> str:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    t = read_target_config(target_dir)
    layer = LlamaConfig(**target_layer_fields(t), num_hidden_layers=num_layers)
    vocab = int(t["vocab_size"])
    dv = int(draft_vocab_size or vocab)
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=dv,
        norm_before_residual=norm_before_residual,
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        norm_output=norm_output,
        eagle_aux_hidden_state_layer_ids=list(aux_layers),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(target_dir), architectures=t.get("architectures")
            ),
        ),
    )
    model = Eagle3DraftModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_"):
                continue
            if p.dim() == 2 and name != "embed_tokens.weight":
                gain = 4.0 if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[1] ** 0.5)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        if dv < vocab:
            load_random_vocab_mapping(model, vocab, dv, gen)
    model.save_pretrained(str(out_dir))
    if not own_embed:
        path = Path(out_dir) / "model.safetensors"
        with safe_open(str(path), framework="pt") as f:
            w = {k: f.get_tensor(k) for k in f.keys() if k != "embed_tokens.weight"}
        save_file(w, str(path), {"format": "pt"})
    return str(out_dir)


def to_legacy_layout(spec_dir: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """The head of spec_dir in the legacy LlamaForCausalLMEagle3 layout (one layer only)."""
    raw = json.loads((Path(spec_dir) / "config.json").read_text())
    layer = dict(raw["transformer_layer_config"])
    if layer.get("num_hidden_layers", 1) != 1 or raw.get("norm_before_fc") or raw.get("fc_norm"):
        raise ValueError("the legacy layout has one layer and no fc norms")
    with safe_open(str(Path(spec_dir) / "model.safetensors"), framework="pt") as f:
        w = {
            k.replace("layers.0.", "midlayer.", 1): f.get_tensor(k)
            for k in f.keys()
            if not k.startswith("verifier_")
        }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"), {"format": "pt"})
    layer.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=raw["draft_vocab_size"],
        norm_before_residual=raw["norm_before_residual"],
        tie_word_embeddings=False,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": raw["eagle_aux_hidden_state_layer_ids"],
            "use_aux_hidden_state": True,
        },
    )
    (out / "config.json").write_text(json.dumps(layer, indent=2))
    return str(out)


class SpeculatorsReference:
    """speculators' Eagle3DraftModel (eager attention, fp32) fed by HF's aux hidden states."""

    def __init__(
        self, head_dir: str | os.PathLike, target_dir: str | os.PathLike, hf_target=None
    ) -> None:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from transformers import AutoModelForCausalLM

        cfg = Eagle3SpeculatorConfig.from_pretrained(str(head_dir))
        # The verifier fills what the head does not ship (its embedding); local folder only.
        cfg.speculators_config.verifier.name_or_path = str(target_dir)
        cfg.transformer_layer_config._attn_implementation = "eager"
        self.model = Eagle3DraftModel.from_pretrained(str(head_dir), config=cfg).float().eval()
        self.hf = hf_target or (
            AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        )
        with safe_open(str(Path(head_dir) / "model.safetensors"), framework="pt") as f:
            ships_embed = "embed_tokens.weight" in f.keys()
        if not ships_embed:
            # speculators 0.9 fills a missing embedding from the verifier only when the
            # weight is still NaN after from_pretrained, which transformers 5.23 does not
            # always leave it: copy the verifier's table explicitly.
            with torch.no_grad():
                self.model.embed_tokens.weight.copy_(self.hf.model.embed_tokens.weight)
        self.taps = list(self.model.config.eagle_aux_hidden_state_layer_ids)
        dv = self.model.draft_vocab_size
        d2t = self.model.d2t if self.model.d2t is not None else torch.zeros(dv, dtype=torch.long)
        self.draft_to_target = torch.arange(dv) + d2t

    @torch.no_grad()
    def aux_hidden_states(self, ids: list[int]) -> torch.Tensor:
        """[T, num_taps * H]: the stream entering layer L, which is HF's
        output_hidden_states[L] for L < num_layers; HF's last entry is after the final norm,
        so tap num_layers (the stream before that norm) is read at the norm's input."""
        pre_norm: list[torch.Tensor] = []
        hook = self.hf.model.norm.register_forward_hook(lambda m, i, o: pre_norm.append(i[0]))
        try:
            out = self.hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        finally:
            hook.remove()
        hs = list(out.hidden_states[:-1]) + [pre_norm[0]]
        return torch.cat([hs[L][0] for L in self.taps], dim=-1)

    @torch.no_grad()
    def step_logits(
        self, aux: torch.Tensor, next_ids: list[int], ttt_steps: int
    ) -> list[torch.Tensor]:
        """Draft-vocab logits [T, Vd] of each TTT step; next_ids[t] is the token after position
        t (len(next_ids) >= T + ttt_steps - 1 feeds the later steps' teacher-forced tokens)."""
        n = len(next_ids)
        hidden = torch.zeros(1, n, aux.shape[-1])
        hidden[0, : aux.shape[0]] = aux
        caps: list[torch.Tensor] = []
        hook = self.model.lm_head.register_forward_hook(lambda m, i, o: caps.append(o[0]))
        try:
            self.model(
                hidden_states=hidden,
                input_ids=torch.tensor([next_ids]),
                document_ids=torch.zeros(1, n, dtype=torch.long),
                ttt_steps=ttt_steps,
            )
        finally:
            hook.remove()
        return [c[: aux.shape[0]].float() for c in caps]

    def drafts(self, context: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """What the head proposes after `context` (its last token just sampled), drafting
        greedily and feeding its own tokens and hidden states back: (target ids, the logits
        row of each step)."""
        aux = self.aux_hidden_states(context[:-1])
        nxt = list(context[1:])
        out: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(k):
            logits = self.step_logits(aux, nxt + out, step + 1)[step][-1]
            rows.append(logits)
            out.append(int(self.draft_to_target[int(logits.argmax())]))
        return out, rows


def record_drafts(llm) -> list[tuple[list[int], list[int], list[torch.Tensor]]]:
    """Start recording every proposal of a uniproc LLM's speculator: (context ending with the
    token just sampled, its drafts, the draft-vocabulary logits row of each draft step).
    Returns the list the records are appended to."""
    runner = llm.llm_engine.executor.worker.model_runner
    spec = runner.speculator
    draft_ids = spec.model.draft_to_target
    steps: list[torch.Tensor] = []
    orig_logits, orig_propose = spec._compute_logits, spec.propose

    def compute_logits(hidden, draft_step):
        out = orig_logits(hidden, draft_step)
        # Greedy drafting over a reduced vocabulary stays in draft ids (mapped at sampling).
        full = draft_ids is not None and out.shape[-1] != len(draft_ids)
        steps.append(out[:, draft_ids] if full else out)
        return out

    records: list[tuple[list[int], list[int], list[torch.Tensor]]] = []

    def propose(inputs):
        steps.clear()
        drafts = orig_propose(inputs)
        batch, num_sampled = inputs.input_batch, inputs.step.num_sampled
        sampled = inputs.step.sampled
        # The states get this step's sampled tokens after propose returns.
        st = runner.states
        for i, s in enumerate(batch.idx_mapping_np.tolist()):
            if num_sampled[i]:
                ctx = st.token_ids[s, : st.num_tokens[s]].tolist()
                ctx += sampled[i, : num_sampled[i]].tolist()
                records.append((ctx, list(drafts[i]), [x[i].clone() for x in steps]))
        return drafts

    spec._compute_logits, spec.propose = compute_logits, propose
    return records
