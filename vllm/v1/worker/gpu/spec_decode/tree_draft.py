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
from vllm.v1.worker.gpu.spec_decode.tree import StaticTree, ancestor_mask
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import (
        AutoRegressiveSpeculator,
        DraftBatch,
    )


def _top_tokens(spec: AutoRegressiveSpeculator, logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] the draft's k most likely target token ids (through a draft vocabulary's map)."""
    return _to_target(spec, logits.topk(k, dim=-1).indices)


def draft_tree(
    spec: AutoRegressiveSpeculator,
    db: DraftBatch,
    hidden_states: torch.Tensor,
    tree: StaticTree,
    ks: np.ndarray,
) -> np.ndarray:
    """Drafts [num_reqs, num_nodes] in the tree's order: the first ks[r] nodes of request r
    at least (the passes after the first run only requests with ks > 0, each the nodes the
    deepest of them needs; PAD_TOKEN_ID elsewhere)."""
    N = tree.num_nodes
    dev = spec.device
    drafts = np.full((db.num_reqs, N), PAD_TOKEN_ID, dtype=np.int64)
    logits_h, feedback, lti = first_pass(spec, db, hidden_states)
    out_rows = np.flatnonzero(ks > 0)
    if not len(out_rows):
        return drafts
    want = int(ks.max())
    roots = db.last_token_indices[out_rows]  # each root's row in the last pass (tree_pass)
    db, lti = _only(db, lti, out_rows)
    R = db.num_reqs
    depth, parents, ranks = tree.depth[:want], tree.parents[:want], tree.ranks[:want]
    root_fb = feedback[lti]  # [R, H] what the depth-1 nodes read
    node_fb: torch.Tensor | None = None  # [R, n, H] each computed node's output hidden state
    tokens = torch.zeros(R, want, dtype=torch.int64, device=dev)
    top = _top_tokens(spec, spec._compute_logits(logits_h[lti], 0), int(ranks.max()) + 1)
    level = np.flatnonzero(depth == 1)
    tokens[:, level] = top[:, ranks[level]]
    for d in range(1, int(depth.max())):
        n = int(np.searchsorted(depth, d, side="right"))  # nodes of depth <= d
        nxt = np.flatnonzero(depth == d + 1)
        par = np.broadcast_to(parents[:n], (R, n))
        logits_h, node_fb = node_pass(
            spec, db, tokens[:, :n], par, depth[:n], root_fb, node_fb, d, roots
        )
        roots = np.arange(R) * n
        level = np.flatnonzero(depth == d)
        k = int(ranks[nxt].max()) + 1
        lg = spec._compute_logits(logits_h[:, level].reshape(R * len(level), -1), d)
        top = _top_tokens(spec, lg, k).view(R, len(level), k)
        where = np.searchsorted(level, parents[nxt])  # each new node's parent within `level`
        tokens[:, nxt] = top[:, where, ranks[nxt]]
    drafts[out_rows, :want] = tokens.cpu().numpy()
    return drafts


def _only(db: DraftBatch, lti: torch.Tensor, rows: np.ndarray) -> tuple[DraftBatch, torch.Tensor]:
    """The batch and last-row indices of these requests only (as they are when all)."""
    if len(rows) == db.num_reqs:
        return db, lti
    return db.take(rows), lti[torch.from_numpy(rows).to(lti.device)]


def first_pass(spec: AutoRegressiveSpeculator, db: DraftBatch, hidden_states: torch.Tensor):
    """The chain drafter's step 0 (writes the draft's KV at every position the target computed);
    returns (logits hidden, feedback hidden, each request's last accepted row)."""
    R = db.num_reqs
    dev = spec.device
    lti = torch.from_numpy(db.last_token_indices).to(dev)
    spec.last_token_indices[:R] = lti
    logits_h, feedback = spec.run_step0(db, hidden_states)
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
    roots: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree-masked draft forward over n nodes per request: tokens [R, n], parents [R, n]
    (-1: the root; a parent always comes before its child), depth [n] (the same for every
    request). Node j runs at position last + depth[j], writes the slot of position
    last + 1 + j and reads its parent's output hidden state (node_fb [R, >= n, H], the root's:
    root_fb [R, H]). roots [R]: each request's root row in the pass before (the draft's
    first pass, or the last node pass). Returns (logits hidden [R, n, H], output hidden
    [R, n, H])."""
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
    with spec.tree_pass(roots, n):
        logits_h, fb = spec._run_model(
            tokens.reshape(-1),
            torch.from_numpy(pos.reshape(-1)).to(dev),
            hid.reshape(R * n, -1),
            meta,
            step,
        )
    return logits_h.view(R, n, -1), fb.view(R, n, -1)


def draft_dynamic(
    spec: AutoRegressiveSpeculator,
    db: DraftBatch,
    hidden_states: torch.Tensor,
    num_nodes: int,
    top_k: int,
    max_depth: int,
    ks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dynamic tree (EAGLE-2): (drafts [R, num_nodes], parents [R, num_nodes], each node's
    path log-probability [R, num_nodes], -inf where no node is kept).

    Depth 1: the draft's top_k tokens after the root. At each depth the top_k candidates with
    the highest path probability (the product of the draft's probabilities along the path)
    are expanded - run through the draft, their top_k children become candidates - within a
    budget of num_nodes expanded nodes (their draft KV must fit the slots after the root).
    Then the num_nodes most probable candidates of all depths are kept, ordered by probability
    (ties: the shallower first). A child is never more probable than its parent, so every kept
    node's parent is kept and comes before it, and any prefix of k nodes is the k most probable
    connected subtree: what a request verifying k of them (the scheduler's adaptive K) checks.
    ks [R]: the nodes each request verifies; the passes after the first run only requests
    with ks > 0, each growing the tree the largest needs. TP: rank 0's choices (spec.agree)."""
    N = num_nodes
    R_all = db.num_reqs
    dev = spec.device
    drafts = np.full((R_all, N), PAD_TOKEN_ID, dtype=np.int64)
    parents_out = np.full((R_all, N), -1, dtype=np.int64)
    parents_out[:, 1:] = np.arange(N - 1)  # unused columns: a chain (never verified)
    scores = np.full((R_all, N), -np.inf, dtype=np.float32)
    logits_h, feedback, lti = first_pass(spec, db, hidden_states)
    out_rows = np.flatnonzero(ks > 0)
    if not len(out_rows):
        return drafts, parents_out, scores
    want = int(ks.max())
    roots = db.last_token_indices[out_rows]  # each root's row in the last pass (tree_pass)
    db, lti = _only(db, lti, out_rows)
    R = db.num_reqs
    root_fb = feedback[lti]
    k = min(top_k, want)
    lp = torch.log_softmax(spec._compute_logits(logits_h[lti], 0).float(), -1)
    score, idx = lp.topk(k, dim=-1)
    # Candidates (per request, same count): token, parent candidate (-1: root), score, depth.
    c_tok = _to_target(spec, idx)
    c_par = torch.full((R, k), -1, dtype=torch.int64, device=dev)
    c_score, c_depth = score, torch.ones(R, k, dtype=torch.int64, device=dev)
    run: torch.Tensor | None = None  # [R, n] candidate index of each expanded node
    node_fb: torch.Tensor | None = None
    level_lo = 0  # first candidate index of the current depth
    for d in range(1, max_depth):
        n_run = 0 if run is None else run.shape[1]
        e = min(top_k, want - n_run, c_tok.shape[1] - level_lo)
        if e <= 0:
            break
        # The e best candidates of depth d, expanded.
        best = c_score[:, level_lo:].topk(e, dim=-1).indices + level_lo
        best = spec.agree(best)
        run = best if run is None else torch.cat([run, best], 1)
        n = run.shape[1]
        # Expanded nodes' parents as indices into `run` (their parent was expanded before).
        cand_par = torch.gather(c_par, 1, run)
        pos_of = torch.full((R, c_tok.shape[1] + 1), -1, dtype=torch.int64, device=dev)
        pos_of.scatter_(1, run, torch.arange(n, device=dev).expand(R, n))
        run_par = torch.where(cand_par >= 0, torch.gather(pos_of, 1, cand_par.clamp(min=0)), -1)
        depth = torch.gather(c_depth, 1, run)[0].cpu().numpy()
        logits_h, node_fb = node_pass(
            spec,
            db,
            torch.gather(c_tok, 1, run),
            run_par.cpu().numpy(),
            depth,
            root_fb,
            node_fb,
            d,
            roots,
        )
        roots = np.arange(R) * n
        lg = spec._compute_logits(logits_h[:, n - e :].reshape(R * e, -1), d)
        lp = torch.log_softmax(lg.float(), -1).view(R, e, -1)
        s, i = lp.topk(k, dim=-1)  # [R, e, k]
        s = s + torch.gather(c_score, 1, best)[:, :, None]
        level_lo = c_tok.shape[1]
        c_tok = torch.cat([c_tok, _to_target(spec, i).reshape(R, e * k)], 1)
        c_par = torch.cat([c_par, best[:, :, None].expand(R, e, k).reshape(R, e * k)], 1)
        c_score = torch.cat([c_score, s.reshape(R, e * k)], 1)
        c_depth = torch.cat([c_depth, torch.full((R, e * k), d + 1, device=dev)], 1)
    # The `want` most probable candidates (ties: the shallower first), most probable first.
    m = min(want, c_tok.shape[1])
    key = c_score - 1e-4 * c_depth.float()
    keep = spec.agree(key.topk(m, dim=-1, sorted=True).indices)
    keep_np = keep.cpu().numpy()
    par_np, tok_np = c_par.cpu().numpy(), c_tok.cpu().numpy()
    score_np = c_score.float().cpu().numpy()
    for r, out in enumerate(out_rows.tolist()):
        order = keep_np[r]
        scores[out, :m] = score_np[r, order]
        new_index = {int(c): j for j, c in enumerate(order)}
        drafts[out, :m] = tok_np[r, order]
        parents_out[out, :m] = [new_index.get(int(par_np[r, c]), -1) for c in order]
        assert (parents_out[out, :m] < np.arange(m)).all(), "a kept node before its parent"
    # One tree on every TP rank: the order above read each rank's own scores.
    both = spec.agree(torch.from_numpy(np.stack([drafts, parents_out])))
    both_np = both.cpu().numpy()
    return both_np[0], both_np[1], scores


def _to_target(spec: AutoRegressiveSpeculator, idx: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids as target ids (TP ranks agreeing on them)."""
    vocab = getattr(spec, "draft_vocab", None)
    if vocab is not None and vocab.draft_to_target is not None:
        idx = vocab.draft_to_target[idx]
    return spec.agree(idx)


def propose_tree(
    spec: AutoRegressiveSpeculator,
    db: DraftBatch,
    hidden_states: torch.Tensor,
    tree: StaticTree | None,
    num_steps: int | np.ndarray | None,
) -> np.ndarray | None:
    """The drafts of a configured tree (static, or dynamic: the parents are left in
    spec.tree_parents for the verifier), or None without one. num_steps: the nodes the
    scheduler verifies next step, per request or one count for all (None: every node); a
    request's nodes after them are PAD_TOKEN_ID."""
    cfg = spec.speculative_config
    if cfg.num_tree_nodes is None and tree is None:
        return None
    N = cfg.num_tree_nodes if tree is None else tree.num_nodes
    assert N is not None
    R = db.num_reqs
    ks = np.clip(np.broadcast_to(N if num_steps is None else num_steps, (R,)), 0, N)
    if cfg.num_tree_nodes is not None:
        assert cfg.tree_top_k is not None and cfg.tree_max_depth is not None
        drafts, parents, scores = draft_dynamic(
            spec, db, hidden_states, cfg.num_tree_nodes, cfg.tree_top_k, cfg.tree_max_depth, ks
        )
        spec.tree_parents = parents
        if spec.confidence is not None:  # a node's confidence: its path's probability
            spec.confidence.set(np.exp(scores))
    else:
        assert tree is not None
        drafts = draft_tree(spec, db, hidden_states, tree, ks)
    drafts[np.arange(N)[None, :] >= ks[:, None]] = PAD_TOKEN_ID
    return drafts
