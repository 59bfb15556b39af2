# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Drafting a static tree with an autoregressive draft head (EAGLE3, EAGLE-1).

Step 0 is the chain drafter's: the draft runs over the target's step (seen as a chain, see
tree.py) and writes its KV for every position the target computed; its output at each request's
last accepted row gives the depth-1 distribution. Then depth by depth: the pass for depth d
runs every node of depth <= d as one request's query rows (node i at position last + depth(i),
writing the draft's KV into the slot of position last + 1 + i, seeing its cached context and
its ancestors through the tree mask, reading its parent's output hidden state), and the
children of each depth-d node are the top ranks of its distribution the tree names. Earlier
depths are recomputed (the same inputs give the same values) so each pass is one tree-masked
forward of at most num_nodes rows per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.forward_context import decode_rows
from vllm.v1.worker.gpu.spec_decode.tree import StaticTree, ancestor_mask
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
        AutoRegressiveSpeculator,
        DraftBatch,
    )


def _top_tokens(spec: AutoRegressiveSpeculator, logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] the draft's k most likely target token ids (through a draft vocabulary's map)."""
    idx = logits.topk(k, dim=-1).indices
    vocab = getattr(spec, "draft_vocab", None)
    if vocab is not None and vocab.draft_to_target is not None:
        idx = vocab.draft_to_target[idx]
    return spec.agree(idx)


def draft_tree(
    spec: AutoRegressiveSpeculator,
    db: DraftBatch,
    hidden_states: torch.Tensor,
    tree: StaticTree,
    num_steps: int | None,
) -> np.ndarray:
    """Drafts [num_reqs, num_nodes] in the tree's order (PAD_TOKEN_ID past num_steps)."""
    N = tree.num_nodes
    want = N if num_steps is None else max(0, min(N, num_steps))
    R = db.num_reqs
    dev = spec.device
    drafts = np.full((R, N), PAD_TOKEN_ID, dtype=np.int64)
    logits_h, feedback, lti = first_pass(spec, db, hidden_states)
    if want == 0:
        return drafts
    depth, parents, ranks = tree.depth[:want], tree.parents[:want], tree.ranks[:want]
    root_fb = feedback[lti]  # [R, H] what the depth-1 nodes read
    node_fb: torch.Tensor | None = None  # [R, n, H] each computed node's output hidden state
    tokens = torch.zeros(R, want, dtype=torch.int64, device=dev)
    with decode_rows():
        top = _top_tokens(spec, spec._compute_logits(logits_h[lti], 0), int(ranks.max()) + 1)
    level = np.flatnonzero(depth == 1)
    tokens[:, level] = top[:, ranks[level]]
    for d in range(1, int(depth.max())):
        n = int(np.searchsorted(depth, d, side="right"))  # nodes of depth <= d
        nxt = np.flatnonzero(depth == d + 1)
        par = np.broadcast_to(parents[:n], (R, n))
        logits_h, node_fb = node_pass(spec, db, tokens[:, :n], par, depth[:n], root_fb, node_fb, d)
        level = np.flatnonzero(depth == d)
        k = int(ranks[nxt].max()) + 1
        with decode_rows():
            lg = spec._compute_logits(logits_h[:, level].reshape(R * len(level), -1), d)
        top = _top_tokens(spec, lg, k).view(R, len(level), k)
        where = np.searchsorted(level, parents[nxt])  # each new node's parent within `level`
        tokens[:, nxt] = top[:, where, ranks[nxt]]
    drafts[:, :want] = tokens.cpu().numpy()
    return drafts


def first_pass(spec: AutoRegressiveSpeculator, db: DraftBatch, hidden_states: torch.Tensor):
    """The chain drafter's step 0 (writes the draft's KV at every position the target computed);
    returns (logits hidden, feedback hidden, each request's last accepted row)."""
    R = db.num_reqs
    dev = spec.device
    lti = torch.from_numpy(db.last_token_indices).to(dev)
    spec.last_token_indices[:R] = lti
    ids0 = torch.from_numpy(db.input_ids).to(dev)
    embeds0 = None
    if db.mm_rows is not None and db.mm_embeds is not None and len(db.mm_rows):
        embeds0 = spec.draft.embed_input_ids(ids0, 0).clone()
        embeds0[torch.from_numpy(db.mm_rows).to(dev)] = db.mm_embeds.to(embeds0.dtype)
    logits_h, feedback = spec._run_model(
        ids0,
        torch.from_numpy(db.positions).to(dev),
        hidden_states,
        db.attn_metadata,
        0,
        inputs_embeds=embeds0,
    )
    return logits_h, feedback, lti


def node_pass(
    spec: AutoRegressiveSpeculator,
    db: DraftBatch,
    tokens: torch.Tensor,
    parents: np.ndarray,
    depth: np.ndarray,
    root_fb: torch.Tensor,
    node_fb: torch.Tensor | None,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-masked draft forward over n nodes per request: tokens [R, n], parents [R, n]
    (-1: the root; a parent always comes before its child), depth [n] (the same for every
    request). Node j runs at position last + depth[j], writes the slot of position
    last + 1 + j and reads its parent's output hidden state (node_fb [R, >= n, H], the root's:
    root_fb [R, H]). Returns (logits hidden [R, n, H], output hidden [R, n, H])."""
    R, n = tokens.shape
    dev = spec.device
    max_pos = spec.max_model_len - 1
    pos = np.minimum(db.last[:, None] + depth[None, :], max_pos)  # [R, n]
    slot_pos = np.minimum(db.last[:, None] + 1 + np.arange(n)[None], max_pos)
    bs = spec.block_size
    blk = np.take_along_axis(
        db.block_table, np.minimum(slot_pos // bs, db.block_table.shape[1] - 1), axis=1
    )
    slots = (blk * bs + slot_pos % bs).reshape(-1)
    meta = build_attn_metadata(
        np.arange(R + 1, dtype=np.int64) * n,
        slot_pos[:, -1] + 1,
        db.block_table,
        bs,
        dev,
        slot_mapping=torch.from_numpy(slots).to(dev),
        positions=pos.reshape(-1),
        short_query_len=n,
    )
    masks = np.stack([ancestor_mask(parents[r])[1:, 1:] for r in range(R)]) if R else None
    meta.tree_mask = torch.from_numpy(masks).to(dev) if masks is not None else None
    hid = root_fb[:, None, :].expand(R, n, root_fb.shape[-1]).clone()
    rr, jj = np.nonzero(parents >= 0)
    if len(rr):
        assert node_fb is not None
        hid[torch.from_numpy(rr), torch.from_numpy(jj)] = node_fb[
            torch.from_numpy(rr), torch.from_numpy(parents[rr, jj])
        ]
    logits_h, fb = spec._run_model(
        tokens.reshape(-1),
        torch.from_numpy(pos.reshape(-1)).to(dev),
        hid.reshape(R * n, -1),
        meta,
        step,
    )
    return logits_h.view(R, n, -1), fb.view(R, n, -1)
