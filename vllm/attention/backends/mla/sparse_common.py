# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Common part of the sparse MLA backends (DeepSeek-V3.2 DSA): the view every sparse impl has of
the model-wide top-k indices buffer, and the impl that attends only to the selected positions
(backends supply the attention core)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm.attention.backends.mla.torch_mla import MLADims, TorchMLAImpl
from vllm.attention.backends.torch_paged import AttentionMetadata, extra_mask

# Entry value of an unused top-k slot (fewer selectable positions than index_topk).
TOPK_PAD = -1


class SharedTopkIndicesBuffer:
    """Mixin giving a sparse MLA impl its view of the model-wide top-k indices buffer.

    The buffer ([max_num_batched_tokens, index_topk] int32, positions in each token's request
    context, TOPK_PAD for unused slots) is resolved on every read: from the indexer when one is
    attached, else from the explicitly given buffer. Draft loading re-points the draft indexers'
    buffers to the target's after the impls were built; a snapshot taken at construction would
    read a buffer nobody writes. Assigning `topk_indices_buffer` sets an explicit buffer and
    detaches the indexer (explicit wins).
    """

    def init_topk_indices_buffer(
        self, indexer: Any | None = None, buffer: torch.Tensor | None = None
    ) -> None:
        # object.__setattr__: on an nn.Module host the indexer must not become a submodule.
        object.__setattr__(self, "_topk_indexer", indexer)
        object.__setattr__(self, "_topk_explicit_buffer", buffer)

    @property
    def topk_indices_buffer(self) -> torch.Tensor | None:
        indexer = self.__dict__.get("_topk_indexer")
        if indexer is not None:
            return indexer.topk_indices_buffer
        return self.__dict__.get("_topk_explicit_buffer")

    @topk_indices_buffer.setter
    def topk_indices_buffer(self, buffer: torch.Tensor | None) -> None:
        self.init_topk_indices_buffer(None, buffer)


class SparseMLACommonImpl(TorchMLAImpl, SharedTopkIndicesBuffer):
    """MLA attending, for each query token, only to the context positions its indexer selected.

    The latent cache layout, the write and the q/out projections are the dense impl's; only the
    attention core differs. Backends implement `sparse_attend`. When every context of the step is
    no longer than topk_tokens the selection is the whole (causal) context, so the dense path is
    used; it gives the same result.
    """

    is_sparse = True

    def __init__(
        self,
        dims: MLADims,
        topk_tokens: int,
        indexer: Any | None = None,
        topk_indices_buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__(dims)
        self.topk_tokens = int(topk_tokens)
        self.dense_when_short = True
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    def attend_latent(
        self, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata, mask_fn=None
    ) -> torch.Tensor:
        if mask_fn is not None:
            raise ValueError(f"{type(self).__name__} takes its mask from the top-k indices")
        if self.dense_when_short and int(np.max(meta.seq_lens_np, initial=0)) <= self.topk_tokens:
            return super().attend_latent(q, latent, meta)
        slots = self.topk_slots(meta)
        return self.sparse_attend(q, latent, slots)

    def topk_slots(self, meta: AttentionMetadata) -> torch.Tensor:
        """[T, topk] cache slot of every selected position of every query token (-1: none).

        Rows of tokens whose context fits in topk select their whole causal context, whatever
        the buffer holds (a row reused from an earlier draft step may predate this position).
        A draft tree's node (meta.tree_mask) sees its cached context and its ancestors only:
        the buffer's entries outside them are dropped, and a node with at most topk of them
        selects them all in position order - what the same token selects in a causal
        sequence (its ancestors sit in increasing positions)."""
        buf = self.topk_indices_buffer
        if buf is None:
            raise RuntimeError(f"{type(self).__name__} has no top-k indices buffer")
        T, k = meta.num_tokens, self.topk_tokens
        if T > buf.shape[0]:
            raise RuntimeError(
                f"{T} tokens in one forward exceed the top-k buffer's {buf.shape[0]} rows"
            )
        out = torch.full((T, k), -1, dtype=torch.long, device=buf.device)
        ar = torch.arange(k, device=buf.device)
        tree_fn = extra_mask(meta, None) if meta.tree_mask is not None else None
        for g in meta.groups:
            q_len, s_len = g.q_index.shape[1], g.kv_slots.shape[1]
            row = g.valid // q_len
            q_pos = g.q_positions.reshape(-1)[g.valid].unsqueeze(1)  # [n, 1]
            sel = buf[g.token_index].long()
            sel = torch.where(q_pos < k, ar.unsqueeze(0), sel)
            ok = (sel >= 0) & (sel <= q_pos)
            if tree_fn is not None:
                sel, ok = _tree_selection(tree_fn(g), g.valid, q_pos, sel, ok)
            slots = g.kv_slots[row].gather(1, sel.clamp(0, s_len - 1))
            out[g.token_index] = torch.where(ok, slots, -1)
        return out

    def sparse_attend(
        self, q: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, rank + rope] over latent [num_slots, 1, rank + rope] restricted to each
        token's slots [T, topk] (-1 = unused); returns [T, H, rank]."""
        raise NotImplementedError


def _tree_selection(
    allowed: torch.Tensor,
    valid: torch.Tensor,
    q_pos: torch.Tensor,
    sel: torch.Tensor,
    ok: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sel, ok) of a group's valid tokens under a tree mask (allowed [Rg, 1, Qg, Sg]): entries
    outside the node's context and ancestors dropped; a node seeing at most topk keys selects
    them all, in position order."""
    n, k = sel.shape
    seen = allowed.reshape(-1, allowed.shape[-1])[valid]  # [n, Sg]
    seen = seen & (torch.arange(seen.shape[1], device=seen.device)[None, :] <= q_pos)
    count = seen.sum(-1, keepdim=True)
    few = count <= k
    if bool(few.any()):
        width = min(k, seen.shape[1])
        # The allowed columns first, in increasing order (a stable sort of "not allowed").
        order = torch.sort((~seen).to(torch.int8), dim=-1, stable=True).indices[:, :width]
        asc = torch.full_like(sel, -1)
        asc[:, :width] = order
        asc = torch.where(torch.arange(k, device=sel.device)[None, :] < count, asc, -1)
        sel = torch.where(few, asc, sel)
        ok = torch.where(few, asc >= 0, ok)
    ok = ok & seen.gather(1, sel.clamp(0, seen.shape[1] - 1))
    return sel, ok
