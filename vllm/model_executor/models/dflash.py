# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DFlash and DSpark draft heads: block-parallel drafting from the target's aux hidden states.

One forward drafts a whole block. The block holds Q positions a .. a+Q-1 after the context
0 .. a-1: slot 0 the anchor token (the token just sampled, at position a), every other slot
`mask_token_id`. Its queries attend to the context and, bidirectionally, to the whole block.
The context is not the draft's own stream: every draft layer takes its keys and values from
ctx = hidden_norm(fc(cat(aux taps))) of each context position (shared by all layers), so they
are computed once per target position and kept in the draft's paged KV cache. Per layer:
  q = q_norm(q_proj(input_layernorm(x)));  k = k_norm(k_proj(.)), v = v_proj(.) of both the
  context (from ctx) and the block (from input_layernorm(x)); RoPE at the true positions;
  x = x + o_proj(attn);  x = x + mlp(post_attention_layernorm(x)).
logits = lm_head(norm(x)) over the draft vocabulary (target id = draft id + d2t[draft id]).
Slot j predicts the token at a + j (sample_from_anchor false: drafts come from slots 1..Q-1)
or at a + j + 1 (sample_from_anchor true: drafts from slots 0..Q-1).

DSpark adds, on the block's logits, a low-rank Markov bias from the previous token of each slot
(the anchor, then the token drafted at the slot before): vanilla W2(W1[prev]), gated
W2(sigmoid(gate([h; W1[prev]])) * W1[prev]), or rnn (a recurrent state over the slots); being
sequential, it is applied slot by slot as the block's tokens are drafted. Its confidence head
sigmoid(proj([h; W1[prev]])) estimates each slot's acceptance probability.

Checkpoints: the speculators format (`speculators_model_type` "dflash" / "dspark", flattened by
vllm/transformers_utils/speculators.py; taps = the stream entering target layer L) and native
DFlash configs (`dflash_config.target_layer_ids` = output of layer i, tapped at i + 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.config.draft import (
    dflash_field,
    get_eagle3_aux_layers_from_config,
    sample_from_anchor,
)
from vllm.forward_context import ForwardContext, RowKinds
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope, rope_params
from vllm.model_executor.models.draft import DraftVocabModel, check_combined_taps
from vllm.model_executor.models.interfaces import CombinesHiddenStates, TargetShares
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.utils import load_params_strict
from vllm.sequence import IntermediateTensors


@dataclass
class BlockAttentionMetadata:
    """Where each block's context lives: R blocks of Q rows; ctx_slots [R, S] the cache slot
    of context position s < ctx_len[r] (0 elsewhere), ctx_valid [R, S] which are real."""

    num_blocks: int
    query_len: int
    ctx_slots: torch.Tensor
    ctx_valid: torch.Tensor

    @classmethod
    def build(
        cls,
        ctx_lens: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
        query_len: int,
        device: torch.device,
    ) -> BlockAttentionMetadata:
        ctx_lens = np.asarray(ctx_lens, dtype=np.int64)
        s = max(int(ctx_lens.max()) if len(ctx_lens) else 0, 1)
        j = np.arange(s)[None, :]
        valid = j < ctx_lens[:, None]
        blocks = np.take_along_axis(
            block_table, np.minimum(j // block_size, block_table.shape[1] - 1), axis=1
        )
        slots = np.where(valid, blocks * block_size + j % block_size, 0)
        return cls(
            len(ctx_lens),
            query_len,
            torch.from_numpy(slots).to(device),
            torch.from_numpy(valid).to(device),
        )


class DFlashAttention(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        h = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or h // self.num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        hd = self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, eps)
        self.k_norm = RMSNorm(hd, eps)
        theta, scaling = rope_params(config)
        self.rotary_emb = get_rope(
            hd, hd, int(config.max_position_embeddings), theta, is_neox_style=True, scaling=scaling
        )
        # Owns the paged cache of the context keys / values (allocated by the runner).
        self.attn = Attention(
            self.num_heads, hd, hd**-0.5, self.num_kv_heads, prefix=f"{prefix}.attn"
        )

    def _kv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        _, k = self.rotary_emb(positions, k, k)
        return k, v

    def write_context(
        self, positions: torch.Tensor, ctx: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        cache = self.attn.kv_cache
        if cache is None:
            return
        k, v = self._kv(positions, ctx)
        cache[0][slot_mapping] = k.to(cache.dtype)
        cache[1][slot_mapping] = v.to(cache.dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        meta: BlockAttentionMetadata = ctx.attn_metadata
        n = x.shape[0]
        R, Q = meta.num_blocks, meta.query_len
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(n, H, D))
        k, v = self._kv(positions, x)
        q, _ = self.rotary_emb(positions, q, q)
        cache = self.attn.kv_cache
        if cache is None:  # warm-up without a cache: the block attends to itself only
            k_ctx = k.new_zeros(R, 1, Hkv, D)
            v_ctx = k_ctx
            ctx_valid = torch.zeros(R, 1, dtype=torch.bool, device=x.device)
        else:
            k_ctx = cache[0][meta.ctx_slots].to(k.dtype)
            v_ctx = cache[1][meta.ctx_slots].to(v.dtype)
            ctx_valid = meta.ctx_valid
        keys = torch.cat([k_ctx, k.view(R, Q, Hkv, D)], dim=1).transpose(1, 2)
        vals = torch.cat([v_ctx, v.view(R, Q, Hkv, D)], dim=1).transpose(1, 2)
        mask = torch.cat([ctx_valid, ctx_valid.new_ones(R, Q)], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.view(R, Q, H, D).transpose(1, 2),
            keys,
            vals,
            attn_mask=mask,
            scale=D**-0.5,
            enable_gqa=Hkv != H,
        )
        return self.o_proj(out.transpose(1, 2).reshape(n, H * D))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        h = int(config.hidden_size)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.self_attn = DFlashAttention(config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            h, int(config.intermediate_size), bool(getattr(config, "mlp_bias", False))
        )
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class DFlashModel(nn.Module):
    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        h = int(config.hidden_size)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.embed_tokens = nn.Embedding(int(config.vocab_size), h)
        self.layers = nn.ModuleList(
            [
                DFlashDecoderLayer(config, prefix=f"{prefix}.layers.{i}")
                for i in range(int(config.num_hidden_layers))
            ]
        )
        taps = get_eagle3_aux_layers_from_config(config) or ()
        target_h = int(getattr(config, "target_hidden_size", None) or h)
        self.fc = nn.Linear(len(taps) * target_h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)


class MarkovHead(nn.Module):
    """DSpark's sequential logit bias over the draft vocabulary from each slot's previous
    token (a target-vocabulary id)."""

    def __init__(self, config: Any, draft_vocab_size: int) -> None:
        super().__init__()
        r = int(dflash_field(config, "markov_rank"))
        h = int(config.hidden_size)
        self.head_type = dflash_field(config, "markov_head_type", "vanilla")
        self.rank = r
        self.markov_w1 = nn.Embedding(int(config.vocab_size), r)
        self.markov_w2 = nn.Linear(r, draft_vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)

    def step(
        self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias [R, Vd], next state) of one slot; state is the rnn variant's, None first."""
        if self.head_type == "vanilla":
            return self.markov_w2(prev_emb), None
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
            return self.markov_w2(gate * prev_emb), None
        if state is None:
            state = prev_emb.new_zeros(prev_emb.shape[0], self.rank)
        z = torch.cat([state, prev_emb, hidden], dim=-1)
        gate_raw, cand_raw, out_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DFlashDraftModel(DraftVocabModel, CombinesHiddenStates):
    """DFlash draft (speculators `dflash` folders and native DFlash configs)."""

    model: DFlashModel

    def build_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> DFlashModel:
        config = self.config
        # DSpark's heads (set after this by its __init__).
        self.markov_head: MarkovHead | None = None
        self.confidence_head: ConfidenceHead | None = None
        self.confidence_with_markov = False
        self.mask_token_id = int(dflash_field(config, "mask_token_id"))
        self.block_size = int(dflash_field(config, "block_size"))
        self.sample_from_anchor = sample_from_anchor(config)
        self.init_draft_vocab(config)
        return DFlashModel(config)

    def bind_target(self, shares: TargetShares) -> None:
        super().bind_target(shares)
        check_combined_taps(self, self.model.fc, shares)

    def combine_hidden_states(
        self, hidden_states: torch.Tensor, rows: RowKinds | None
    ) -> torch.Tensor:
        """[T, num_taps * target_hidden] -> the context features [T, hidden] every layer's
        keys and values are computed from (fc is a plain nn.Linear: rows go unused)."""
        m = self.model
        return m.hidden_norm(m.fc(hidden_states.to(m.fc.weight.dtype)))

    def write_context(
        self, positions: torch.Tensor, ctx: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store the context keys / values of positions (features ctx) in every layer's cache."""
        for layer in self.model.layers:
            # nn.ModuleList is untyped: DFlashModel fills it with DFlashDecoderLayer only.
            cast(DFlashDecoderLayer, layer).self_attn.write_context(positions, ctx, slot_mapping)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        *,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """The normed hidden states [R * Q, hidden] of R blocks of Q slots (one block-parallel
        pass, not the autoregressive draft step of the other drafts); ctx.attn_metadata is the
        blocks' BlockAttentionMetadata (which has no request layout: every linear row is
        prefill-kind, BLAS)."""
        x = self.embed_input_ids(input_ids)
        for layer in self.model.layers:
            x = layer(positions, x, ctx)
        return self.model.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if name == "t2d" or name.startswith("verifier_") or "rotary_emb.inv_freq" in name:
                return None  # training-time only
            if name.startswith("model."):
                name = name[len("model.") :]
            if name == "d2t" and self.d2t is None:
                return None  # identity map over a full vocabulary
            if name in ("d2t", "lm_head.weight") or name.split(".")[0] in (
                "markov_head",
                "confidence_head",
            ):
                return name
            return "model." + name

        return self.finish_draft_vocab_loading(load_params_strict(self, weights, rename))


class DSparkDraftModel(DFlashDraftModel):
    """DFlash plus the Markov logit-bias head and the confidence head."""

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__(vllm_config, model_config, prefix)
        config = self.config
        rank = int(dflash_field(config, "markov_rank", 256))
        if rank > 0:
            self.markov_head = MarkovHead(config, self.draft_vocab_size)
        if bool(dflash_field(config, "enable_confidence_head", True)):
            self.confidence_with_markov = bool(
                dflash_field(config, "confidence_head_with_markov", True)
            )
            if self.confidence_with_markov and self.markov_head is None:
                raise ValueError("DSpark: confidence_head_with_markov needs markov_rank > 0")
            dim = int(config.hidden_size) + (rank if self.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim)

    def markov_step(
        self,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """One slot of the sequential heads, for R blocks: prev_tokens [R] (target ids), hidden
        [R, hidden] the slot's normed hidden state. Returns (logit bias [R, Vd] or None,
        acceptance estimate [R] or None, next recurrent state)."""
        bias = None
        prev_emb = None
        if self.markov_head is not None:
            prev_emb = self.markov_head.markov_w1(prev_tokens).to(
                self.markov_head.markov_w2.weight.dtype
            )
            bias, state = self.markov_head.step(prev_emb, hidden, state)
        conf = None
        if self.confidence_head is not None:
            feats = hidden
            if self.confidence_with_markov and prev_emb is not None:
                feats = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
            conf = torch.sigmoid(self.confidence_head.proj(feats).squeeze(-1).float())
        return bias, conf, state
