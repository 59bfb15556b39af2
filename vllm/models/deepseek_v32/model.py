# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V3.2 (and GLM-MoE-DSA) target model: DeepSeek-V3 MLA/MoE plus the DSA lightning
indexer, whose per-token top-k context positions restrict each layer's MLA attention."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.attention.backends.torch_paged import extra_mask
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import ALL_SHORT, ForwardContext
from vllm.model_executor.layers.attention import AttentionLayerBase
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    TOPK_PAD,
    SparseMLAAttention,
)
from vllm.model_executor.layers.gemm import linear
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_params
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2MLAAttention,
    DeepseekV2Model,
    DeepseekV3ForCausalLM,
)
from vllm.model_executor.models.interfaces import TargetShares

# Bound on the [rows, queries, index heads, keys] score block of one indexer chunk, in elements.
_SCORE_BUDGET = 1 << 25


def is_glm_dsa(config: Any) -> bool:
    return getattr(config, "model_type", None) == "glm_moe_dsa"


def layer_has_indexer(config: Any, layer_idx: int) -> bool:
    """GLM-MoE-DSA may mark layers "shared": no indexer, they reuse the previous layer's top-k
    (left in the model-wide buffer). MTP layers (past the list) always run their own."""
    types = getattr(config, "indexer_types", None)
    if types is None or layer_idx >= len(types):
        return True
    if types[layer_idx] not in ("full", "shared"):
        raise ValueError(f"indexer_types[{layer_idx}] must be 'full' or 'shared', got {types!r}")
    return types[layer_idx] == "full"


def check_dsa_config(config: Any) -> None:
    for name in ("index_topk", "index_n_heads", "index_head_dim"):
        v = getattr(config, name, None)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"DSA config field {name} must be a positive integer, got {v!r}")
    if getattr(config, "q_lora_rank", None) is None:
        raise ValueError("DSA models need q_lora_rank (the indexer reads the query latent)")
    if config.index_head_dim < config.qk_rope_head_dim:
        raise ValueError(
            f"index_head_dim={config.index_head_dim} is smaller than "
            f"qk_rope_head_dim={config.qk_rope_head_dim}"
        )


def topk_lowest_position_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest scores along the last dim, equal scores ordered by
    lower index first - the order a stable descending sort gives.

    torch.topk breaks ties arbitrarily (differently for different row lengths, i.e. batch
    layouts), and ties are common here: with few indexer heads every head can be clipped to 0
    by the ReLU. Each score is packed with its index into one int64 key (an order-preserving
    integer image of the float above, the inverted index below), so the keys are distinct."""
    # + 0.0 turns -0.0 into +0.0, which the integer image would otherwise order below it.
    s = (scores.float() + 0.0).contiguous()
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: flip order
    n = s.shape[-1]
    inv_index = (n - 1) - torch.arange(n, device=s.device, dtype=torch.int64)
    _, idx = (ordered * (1 << 32) + inv_index).topk(k, dim=-1)
    return scores.gather(-1, idx), idx


def _rope(config: Any, head_size: int, interleaved: bool) -> RotaryEmbedding:
    theta, scaling = rope_params(config)
    return get_rope(
        head_size,
        int(config.qk_rope_head_dim),
        int(config.max_position_embeddings),
        theta,
        is_neox_style=not interleaved,
        scaling=scaling,
    )


class DeepseekV32IndexerCache(AttentionLayerBase):
    """The indexer's own paged key cache (one index_head_dim key per token slot), allocated by
    the runner like any KV cache and addressed with the same slot mapping."""

    def __init__(self, head_dim: int, prefix: str) -> None:
        super().__init__(prefix)
        self.head_dim = head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks * block_size, self.head_dim)


class DeepseekV32Indexer(nn.Module):
    """Lightning indexer: score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s) / sqrt(D)) over the
    causal context (a draft tree's node: its cached context and its ancestors); writes each
    token's top-index_topk positions (TOPK_PAD-padded) to the shared buffer, equal scores
    resolved toward the lower position so the selection never depends on the batch layout
    (every sparse backend reads this one selection). RoPE covers the first
    qk_rope_head_dim dims: half-split for DeepSeek-V3.2, interleaved pairs for GLM-MoE-DSA (as
    HF transformers).

    Under TP the indexer is replicated (wq_b, wk, weights_proj and the key cache whole on every
    rank, as upstream vLLM and SGLang keep it): each rank scores every head itself, in the same
    order as one rank would, so the selection does not depend on the TP size. Splitting the
    heads and summing partial scores over ranks would add them in another order, and
    candidates whose scores differ in the last bits would swap places at the top-k boundary."""

    def __init__(self, config: Any, prefix: str, topk_indices_buffer: torch.Tensor | None) -> None:
        super().__init__()
        h = config.hidden_size
        self.n_heads = int(config.index_n_heads)
        self.head_dim = int(config.index_head_dim)
        self.index_topk = int(config.index_topk)
        self.wq_b = ReplicatedLinear(
            int(config.q_lora_rank), self.n_heads * self.head_dim, bias=False
        )
        self.wk = ReplicatedLinear(h, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # Kept in float32 whatever the model dtype, as the reference implementation does.
        self.weights_proj = nn.Linear(h, self.n_heads, bias=False, dtype=torch.float32)
        self.softmax_scale = self.head_dim**-0.5
        self.rotary_emb = _rope(config, self.head_dim, interleaved=is_glm_dsa(config))
        self.k_cache = DeepseekV32IndexerCache(self.head_dim, prefix=f"{prefix}.k_cache")
        # A plain attribute (not a registered buffer): the owner of the buffer, which an MTP
        # draft's binding re-points to its target's (None in the draft until then).
        self.topk_indices_buffer = topk_indices_buffer
        self.num_calls = 0  # forwards that computed a selection (tests, benchmarks)

    def forward(
        self,
        hidden_states: torch.Tensor,
        q_c: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> None:
        meta = ctx.attn_metadata
        cache = self.k_cache.kv_cache
        if meta is None or cache is None:
            return  # profiling / dummy run
        T = meta.num_tokens
        buf = self.topk_indices_buffer
        if buf is None:
            raise RuntimeError(
                "the indexer has no top-k indices buffer (an MTP draft's is its target's, "
                "set when the draft is loaded next to it)"
            )
        if T > buf.shape[0]:
            raise RuntimeError(f"{T} tokens exceed the top-k buffer's {buf.shape[0]} rows")
        self.num_calls += 1
        # Rows [:T] of the forward: its kinds still describe them (padding rows come last).
        q = self.wq_b(q_c[:T], ctx.rows).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states[:T], ctx.rows)).unsqueeze(1)
        q, k = self.rotary_emb(positions[:T], q, k)
        cache[meta.slot_mapping] = k[:, 0].to(cache.dtype)
        # Every row as a short row (the small-M kernel): a row's head weights do not depend on
        # how many rows share the call or on the process (with BLAS, nearly tied top-k scores
        # changed with speculation on an AVX512 CPU).
        wp = self.weights_proj.weight
        w = linear(hidden_states[:T].to(wp.dtype), wp, None, ALL_SHORT).float()
        w = w * self.n_heads**-0.5
        q_pad = torch.cat([q.float(), q.new_zeros(1, self.n_heads, self.head_dim).float()])
        w_pad = torch.cat([w, w.new_zeros(1, self.n_heads)])
        buf[:T] = TOPK_PAD
        # A draft tree's rows select among their cached context and their ancestors only.
        tree_fn = extra_mask(meta, None) if meta.tree_mask is not None else None
        for g in meta.groups:
            rows, q_len = g.q_index.shape
            s_len = g.kv_slots.shape[1]
            allowed = g.mask[:, 0] if tree_fn is None else g.mask[:, 0] & tree_fn(g)[:, 0]
            keys = cache[g.kv_slots].float()  # [Rg, Sg, D]
            kk = min(self.index_topk, s_len)
            sel = torch.empty(rows, q_len, kk, dtype=torch.long, device=buf.device)
            step = max(1, _SCORE_BUDGET // max(1, rows * self.n_heads * s_len))
            for a in range(0, q_len, step):
                qi = g.q_index[:, a : a + step]
                scores = torch.einsum("rqhd,rsd->rqhs", q_pad[qi], keys) * self.softmax_scale
                index = torch.einsum("rqh,rqhs->rqs", w_pad[qi], F.relu(scores))
                index = index.masked_fill(~allowed[:, a : a + step], float("-inf"))
                vals, idx = topk_lowest_position_first(index, kk)
                sel[:, a : a + step] = idx.masked_fill(vals == float("-inf"), TOPK_PAD)
            buf[g.token_index, :kk] = sel.reshape(rows * q_len, kk)[g.valid].to(buf.dtype)


class DeepseekV32MLAAttention(DeepseekV2MLAAttention):
    """V3 MLA whose attention is sparse over the indexer's selection (its own indexer, or, for
    GLM "shared" layers, whatever the previous indexer left in the model-wide buffer)."""

    attn: SparseMLAAttention

    def __init__(
        self,
        config: Any,
        prefix: str,
        layer_idx: int,
        topk_indices_buffer: torch.Tensor | None,
    ) -> None:
        super().__init__(config, prefix)
        if self.rotary_emb.is_neox_style:  # V3.2 MLA always rotates interleaved pairs
            self.rotary_emb = _rope(config, self.qk_rope_head_dim, interleaved=True)
        self.skip_topk = False  # set by the MTP draft: reuse the buffer's rows as they are
        self.indexer = (
            DeepseekV32Indexer(config, f"{prefix}.indexer", topk_indices_buffer)
            if layer_has_indexer(config, layer_idx)
            else None
        )
        self.attn = SparseMLAAttention(
            self.mla_dims(config),
            self.kv_b_proj,
            topk_tokens=int(config.index_topk),
            indexer=self.indexer,
            topk_indices_buffer=topk_indices_buffer,
            prefix=f"{prefix}.attn",
        )

    def use_topk_indices_buffer(self, buffer: torch.Tensor) -> None:
        """Select into and attend from `buffer` (an MTP draft layer: its target's). The indexer
        owns the buffer and the sparse impl resolves it through the indexer on every read
        (SharedTopkIndicesBuffer), so re-pointing the owner after the impl was built takes
        effect; a layer without an indexer (GLM "shared") is given the buffer explicitly."""
        if self.indexer is not None:
            self.indexer.topk_indices_buffer = buffer
        else:
            self.attn.topk_indices_buffer = buffer

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe, q_c = self.project(positions, hidden_states, ctx)
        if self.indexer is not None and not self.skip_topk:
            self.indexer(hidden_states, q_c, positions, ctx)
        return self.o_proj(self.attn(q_nope, q_pe, kv_c, k_pe, ctx), ctx.rows)


class DeepseekV32DecoderLayer(DeepseekV2DecoderLayer):
    def __init__(
        self,
        config: Any,
        prefix: str,
        topk_indices_buffer: torch.Tensor | None,
        layer_idx: int | None = None,
    ) -> None:
        if layer_idx is None:
            layer_idx = int(prefix.rsplit(".", 1)[-1])
        attn = DeepseekV32MLAAttention(
            config, f"{prefix}.self_attn", layer_idx, topk_indices_buffer
        )
        super().__init__(config, prefix, layer_idx=layer_idx, self_attn=attn)


def new_topk_indices_buffer(config: Any, rows: int) -> torch.Tensor:
    """[rows, index_topk] int32 on the default device."""
    return torch.full((int(rows), int(config.index_topk)), TOPK_PAD, dtype=torch.int32)


def topk_buffer_rows(vllm_config: VllmConfig) -> int:
    """Rows of the top-k buffer: the most tokens of one forward - a step's budget, or an MTP
    draft's pass over up to K + 1 rows of every request (a tree's node passes run K rows per
    request, which a small token budget may not cover)."""
    rows = int(vllm_config.scheduler_config.max_num_batched_tokens)
    spec = vllm_config.speculative_config
    if spec is not None:
        k = int(spec.num_speculative_tokens or 0)
        rows = max(rows, int(vllm_config.scheduler_config.max_num_seqs) * (k + 1))
    return rows


class DeepseekV32Model(DeepseekV2Model):
    """The decoder; owns the model-wide `topk_indices_buffer` its indexers write and its sparse
    MLA layers read."""

    def __init__(
        self,
        config: Any,
        prefix: str,
        topk_rows: int,
        *,
        tied: bool | None = None,
        keep_embed: bool = False,
    ) -> None:
        check_dsa_config(config)
        # Before the base builds the layers, which are handed the buffer (a plain tensor
        # attribute, so it may be set before nn.Module.__init__).
        self.topk_indices_buffer = new_topk_indices_buffer(config, topk_rows)
        super().__init__(config, prefix, tied=tied, keep_embed=keep_embed)
        if self.start_layer < self.end_layer and not layer_has_indexer(config, self.start_layer):
            raise ValueError(
                f"pipeline stage {get_pp_group().rank} starts at layer {self.start_layer}, whose "
                "indexer_types entry is 'shared' (it reuses the top-k of a layer on another "
                "stage); choose VLLM_PP_LAYER_PARTITION so every stage starts at a 'full' layer"
            )

    def make_layer(self, layer_idx: int, prefix: str) -> nn.Module:
        return DeepseekV32DecoderLayer(
            self.config, prefix, topk_indices_buffer=self.topk_indices_buffer, layer_idx=layer_idx
        )


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 causal LM (DSA sparse MLA + MoE); supports pipeline parallelism."""

    model: DeepseekV32Model

    def _init_model(
        self, vllm_config: VllmConfig, prefix: str, keep_embed: bool
    ) -> DeepseekV32Model:
        return DeepseekV32Model(
            self.config,
            prefix,
            topk_buffer_rows(vllm_config),
            tied=self.tied,
            keep_embed=keep_embed,
        )

    def draft_shares(self) -> TargetShares:
        """The target's shares plus its top-k indices buffer (the MTP draft's indexers write,
        and its sparse attention reads, the target's)."""
        buf = self.model.topk_indices_buffer
        return dataclasses.replace(super().draft_shares(), topk_indices_buffer=buf)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-MoE-DSA (GLM-5): V3.2 with interleaved indexer RoPE and optional "shared" layers."""
