# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft trees verified in one target forward (speculative_config.speculative_token_tree).

A request's K drafts are the nodes of a tree, a parent always before its children (a static
tree breadth first, a dynamic one most probable first: config/spec_tree.py), so a request
verifying k of them verifies the tree of its first k: node i's parent is parents[i] (-1: the
root, the request's last known token) and its depth depth[i].
The scheduler and the KV cache see a chain of K drafts - the same K + 1 query rows, the same
cache slots (row j writes the slot of position start + j) - and only three things differ:
  * layout (apply_layout, every stage, before the forward): row j's position is the root's
    plus its node's depth, and the attention metadata's tree_mask lets it see, of the step's
    rows, only its ancestors and itself (on top of the whole cached context);
  * acceptance (accept, last stage): walk from the root; at each node take the target's own
    token there - keyed by (seed, position) exactly as sampling without speculation keys it -
    and move to the child whose draft equals it; stop where none does. The emitted tokens are
    the target's tokens along the walked path (the last one is the bonus / recovered token),
    so the text equals speculation-free decoding for greedy and seeded requests alike;
  * compaction (compact_kv, every stage): the KV of the accepted path's nodes is copied into
    the slots of positions start + 1 .. start + a, so the cache holds what a chain with a
    accepted drafts would have left (the rest is overwritten later, as rejected drafts are).
The draft then sees the step as that chain (chain_view): rows permuted so the accepted path
comes first, chain positions, no tree mask.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.config.spec_tree import parse_token_tree, tree_parents
from vllm.v1.worker.gpu.sample.logit_controls import needs_controls
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID


@dataclasses.dataclass
class TreePath:
    """The accepted path of one step's tree requests (what compaction needs)."""

    rows: np.ndarray  # batch rows with a tree
    roots: np.ndarray  # flat query row of each one's root
    paths: list[list[int]]  # accepted node indices, root excluded, in depth order


class StaticTree:
    """The static tree of speculative_token_tree (parents, depths, ranks in BFS order)."""

    def __init__(self, paths: list[tuple[int, ...]]) -> None:
        self.paths = paths
        self.parents = np.array(tree_parents(paths), dtype=np.int64)
        self.depth = np.array([len(p) for p in paths], dtype=np.int64)
        self.ranks = np.array([p[-1] for p in paths], dtype=np.int64)
        self.num_nodes = len(paths)

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> StaticTree | None:
        spec = vllm_config.speculative_config
        if spec is None or spec.speculative_token_tree is None:
            return None
        return cls(parse_token_tree(spec.speculative_token_tree))


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[n + 1, n + 1] bool: row 0 the root, row 1 + i node i; [a, b] = b is a's ancestor or
    a itself (parents[i] < i, -1 the root)."""
    n = len(parents)
    m = np.zeros((n + 1, n + 1), dtype=bool)
    m[0, 0] = True
    for i in range(n):
        p = int(parents[i]) + 1
        m[i + 1] = m[p]
        m[i + 1, i + 1] = True
    return m


def is_chain(parents: np.ndarray) -> bool:
    return bool((parents == np.arange(len(parents)) - 1).all())


def apply_layout(batch, parents_of) -> np.ndarray:
    """Give the batch's draft rows their tree positions and tree mask. parents_of(r, k): the
    parents [k] of row r's k drafts. Returns the batch rows holding a (non-chain) tree."""
    k_all = batch.num_draft_tokens_np
    rows = np.flatnonzero(k_all > 0)
    qsl = batch.query_start_loc_np
    trees: list[tuple[int, np.ndarray]] = []
    for r in rows.tolist():
        parents = parents_of(r, int(k_all[r]))
        if not is_chain(parents):
            trees.append((r, parents))
    if not trees:
        return np.zeros(0, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    M = int(q_lens.max())
    mask = np.tril(np.ones((M, M), dtype=bool))[None].repeat(batch.num_reqs, axis=0)
    positions = batch.positions_np.copy()
    for r, parents in trees:
        k = len(parents)
        q = int(q_lens[r])
        root = q - k - 1  # the root's row within the request's query
        anc = ancestor_mask(parents)
        mask[r, root:q, root:q] = anc
        depth = anc[1:, 1:].sum(1)  # a node's depth: its ancestors among nodes, itself included
        lo = int(qsl[r]) + root
        positions[lo + 1 : lo + 1 + k] = positions[lo] + depth
    batch.positions_np = positions
    batch.positions[: len(positions)] = torch.from_numpy(positions).to(batch.positions.device)
    batch.attn_metadata.tree_mask = torch.from_numpy(mask).to(batch.attn_metadata.device)
    return np.array([r for r, _ in trees], dtype=np.int64)


def accept(
    batch, tokens: np.ndarray, parents_of, width: int
) -> tuple[np.ndarray, np.ndarray, TreePath]:
    """(sampled [R, width], num_sampled [R], TreePath) for a batch whose draft rows hold trees.

    tokens [N]: the target's keyed sample of every logits row (a request's root row, then one
    per node). Chains are the special case of a tree whose node i's parent is i - 1."""
    cu = batch.cu_num_logits_np
    drafts_in = batch.input_ids_np[batch.logits_indices_np]
    R = batch.num_reqs
    sampled = np.full((R, width), PAD_TOKEN_ID, dtype=np.int64)
    num_sampled = np.zeros(R, dtype=np.int64)
    t_rows, t_roots, t_paths = [], [], []
    for r in range(R):
        a, b = int(cu[r]), int(cu[r + 1])
        if b == a:
            continue
        k = b - a - 1
        y, d = tokens[a:b], drafts_in[a + 1 : b]
        parents = parents_of(r, k) if k else np.zeros(0, dtype=np.int64)
        path: list[int] = []
        cur = -1
        out = [int(y[0])]
        while True:
            want = out[-1]
            kids = np.flatnonzero((parents == cur) & (d == want))
            if not len(kids):
                break
            cur = int(kids[0])
            path.append(cur)
            out.append(int(y[1 + cur]))
        sampled[r, : len(out)] = out
        num_sampled[r] = len(out)
        if k:
            t_rows.append(r)
            t_roots.append(int(batch.logits_indices_np[a]))
            t_paths.append(path)
    return sampled, num_sampled, TreePath(np.array(t_rows, np.int64), np.array(t_roots), t_paths)


def path_from_result(drafts: np.ndarray, parents: np.ndarray, sampled: np.ndarray) -> list[int]:
    """The accepted path re-derived from a step's drafts [k] and its emitted tokens (what a
    stage without the logits knows): the same walk as accept()."""
    path: list[int] = []
    cur = -1
    for tok in sampled[:-1].tolist():
        kids = np.flatnonzero((parents == cur) & (drafts == tok))
        if not len(kids):
            break
        cur = int(kids[0])
        path.append(cur)
    return path


def compact_kv(
    kv_caches: dict[str, torch.Tensor], num_slots: int, src: np.ndarray, dst: np.ndarray
) -> None:
    """Copy the cache entries of slots src into slots dst (every cache kind: the slot axis is
    the one num_blocks * block_size long). Pairs are applied in order; callers order them so a
    source is never overwritten before it is read (dst <= src, both increasing)."""
    if not len(src):
        return
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if not len(src):
        return
    for cache in kv_caches.values():
        axis = next(i for i, s in enumerate(cache.shape) if s == num_slots)
        s_t = torch.from_numpy(src).to(cache.device)
        d_t = torch.from_numpy(dst).to(cache.device)
        # index_select first: one gather of every source before any write.
        cache.index_copy_(axis, d_t, cache.index_select(axis, s_t))


def path_slots(
    block_table: np.ndarray, block_size: int, root_pos: int, path: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(source slots, destination slots) of one request's accepted path: node i sits at the
    slot of position root_pos + 1 + i, its chain place is root_pos + depth."""
    src_pos = root_pos + 1 + np.asarray(path, dtype=np.int64)
    dst_pos = root_pos + 1 + np.arange(len(path), dtype=np.int64)

    def slot(p: np.ndarray) -> np.ndarray:
        return block_table[p // block_size] * block_size + p % block_size

    return slot(src_pos), slot(dst_pos)


def chain_view(batch, tp: TreePath, hidden: torch.Tensor, aux: list[torch.Tensor] | None):
    """The step as the draft sees it after acceptance: each tree request's rows reordered
    root, accepted path, then the rest; chain positions; no tree mask. Returns (batch, hidden,
    aux, perm) - perm [num_tokens_after_padding] the old row of each new row."""
    perm = np.arange(batch.num_tokens_after_padding, dtype=np.int64)
    positions = batch.positions_np.copy()
    qsl = batch.query_start_loc_np
    for r, root, path in zip(tp.rows.tolist(), tp.roots.tolist(), tp.paths):
        end = int(qsl[r + 1])
        nodes = root + 1 + np.asarray(path, dtype=np.int64)
        rest = np.setdiff1d(np.arange(root + 1, end), nodes)
        perm[root + 1 : end] = np.concatenate([nodes, rest])
        positions[root:end] = positions[root] + np.arange(end - root)
    ids = batch.input_ids_np[perm[: batch.num_tokens]]
    meta = dataclasses.replace(batch.attn_metadata, tree_mask=None, _cache={})
    pos_t = batch.positions.clone()
    pos_t[: len(positions)] = torch.from_numpy(positions).to(pos_t.device)
    view = dataclasses.replace(
        batch,
        input_ids_np=ids,
        positions_np=positions,
        input_ids=batch.input_ids[torch.from_numpy(perm).to(batch.input_ids.device)],
        positions=pos_t,
        attn_metadata=meta,
    )
    p_t = torch.from_numpy(perm).to(hidden.device)
    return view, hidden[p_t], None if aux is None else [a[p_t] for a in aux], perm


class TreeVerifier(RejectionSampler):
    """The model runner's rejection sampler for draft trees: the layout before each forward
    (every stage) and, on the last stage, acceptance, KV compaction (__call__) and the draft's
    chain view of the step (draft_view)."""

    def __init__(self, tree: StaticTree | None, num_nodes: int, runner) -> None:
        super().__init__(num_nodes)
        self.tree = tree
        self.runner = runner
        self._path: TreePath | None = None
        self.accepted_nodes: list[list[int]] | None = None
        # A dynamic tree (tree None): each request's node parents, from the draft's last
        # propose (rows of the batch in _proposed_slots, taken up before the next forward).
        self.slot_parents = np.full((runner.max_num_reqs, num_nodes), -1, dtype=np.int64)
        self._proposed_slots: np.ndarray | None = None

    @classmethod
    def make(cls, runner) -> TreeVerifier | None:
        vllm_config = runner.vllm_config
        spec = vllm_config.speculative_config
        tree = StaticTree.from_config(vllm_config)
        if tree is not None:
            return cls(tree, tree.num_nodes, runner)
        if spec is None or spec.num_tree_nodes is None:
            return None
        return cls(None, spec.num_tree_nodes, runner)

    def _slot_parents(self, slot: int, k: int) -> np.ndarray:
        """The parents of a request's first k nodes. A request with logit controls or a
        grammar verifies its nodes as a chain in tree order (lossless, fewer acceptances):
        both read each row's history as the drafts of the rows before it."""
        p = self.runner.states.params[slot]
        if p is not None and (needs_controls(p) or p.structured_outputs is not None):
            return np.arange(k, dtype=np.int64) - 1
        if self.tree is None:
            return self.slot_parents[slot, :k]
        return self.tree.parents[:k]

    def _parents(self, batch):
        slots = batch.idx_mapping_np
        return lambda row, k: self._slot_parents(int(slots[row]), k)

    def layout(self, input_batch):
        slots, self._proposed_slots = self._proposed_slots, None
        parents = getattr(self.runner.speculator, "tree_parents", None)
        if slots is not None and parents is not None:
            self.slot_parents[slots] = parents[: len(slots)]
        h = self.runner.pp_handler
        if h is not None and h.before_apply is None and not self.runner.pp.is_last_rank:
            h.before_apply = self._compact_from_result
        apply_layout(input_batch, self._parents(input_batch))
        return input_batch

    def _compact_from_result(self, states, result, idx_mapping: np.ndarray) -> None:
        """Pipeline stages before the last: compact this stage's KV from the last stage's
        broadcast result (the path re-derived from the verified drafts and the emitted
        tokens), before the result is applied (the states still hold the verified drafts);
        then take up a dynamic tree's parents of the new drafts (the next step's shape)."""
        run = self.runner
        src, dst = [], []
        live = np.flatnonzero(idx_mapping >= 0)
        for row in live.tolist():
            slot, n = int(idx_mapping[row]), int(result.num_sampled[row])
            k = n + int(result.num_rejected[row]) - 1
            if n == 0 or k <= 0:
                continue
            drafts = states.draft_tokens[slot, :k]
            path = path_from_result(drafts, self._slot_parents(slot, k), result.sampled[row, :n])
            root_pos = int(states.num_computed[slot]) - k - 1
            s, d = path_slots(states.block_table[slot], run.block_size, root_pos, path)
            src.append(s)
            dst.append(d)
        if src:
            num_slots = run.num_blocks * run.block_size
            compact_kv(run.kv_caches, num_slots, np.concatenate(src), np.concatenate(dst))
        if self.tree is None and result.draft_parents is not None:
            self.slot_parents[idx_mapping[live]] = result.draft_parents[live]

    def __call__(self, input_batch, target_tokens):
        b, run = input_batch, self.runner
        sampled, num_sampled, tp = accept(b, target_tokens, self._parents(b), self.max_sample_len)
        self._path = tp if len(tp.rows) else None
        # What the scheduler's K policy learns from (per batch row; ModelRunnerOutput).
        self.accepted_nodes = [[] for _ in range(b.num_reqs)]
        for r, path in zip(tp.rows.tolist(), tp.paths):
            self.accepted_nodes[r] = path
        if self._path is None:
            return sampled, num_sampled
        src, dst = [], []
        for r, root, path in zip(tp.rows.tolist(), tp.roots.tolist(), tp.paths):
            s, d = path_slots(b.block_table_np[r], run.block_size, int(b.positions_np[root]), path)
            src.append(s)
            dst.append(d)
        num_slots = run.num_blocks * run.block_size
        compact_kv(run.kv_caches, num_slots, np.concatenate(src), np.concatenate(dst))
        return sampled, num_sampled

    def draft_view(self, input_batch, hidden, aux, logits):
        tp, self._path = self._path, None
        self._proposed_slots = input_batch.idx_mapping_np
        if tp is None:
            return input_batch, hidden, aux, logits
        b = input_batch
        view, hidden, aux, perm = chain_view(b, tp, hidden, aux)
        if logits is not None:
            # Logits rows follow their query rows: a request's first num_sampled rows are
            # then the ones its emitted tokens were sampled from.
            inv = np.full(len(perm), -1, dtype=np.int64)
            inv[b.logits_indices_np] = np.arange(len(b.logits_indices_np))
            lperm = inv[perm[b.logits_indices_np]]
            logits = logits[torch.from_numpy(lperm).to(logits.device)]
        return view, hidden, aux, logits
