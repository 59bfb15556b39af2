# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The C++ CPU decode kernel with a draft-tree mask against a dense float64 masked attention:
chains, a fork at the root, a deep branch, several requests with different cached contexts
(none, within one block, many blocks: key splits), GQA and MLA's latent form, fp32 and bf16;
a chain-shaped mask gives exactly the unmasked causal kernel's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.test_cpu_paged_attention import BLOCK, MLA, _layout, _tensors, kernels

__all__ = ["kernels"]  # the module fixture: build the kernels or fail

TREES = {
    # parents of the query rows (row 0: the root, -1); topological order
    "chain": [-1, 0, 1, 2, 3],
    "fork_at_root": [-1, 0, 0, 0, 0],
    "deep_branch": [-1, 0, 0, 1, 3, 4, 2, 6],
    "decode": [-1],
}


def _ancestor_or_self(parents: list[int]) -> np.ndarray:
    n = len(parents)
    m = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


def _tree_batch(trees: list[str], ctxs: list[int], M: int):
    q_lens = [len(TREES[t]) for t in trees]
    seq = [c + q for c, q in zip(ctxs, q_lens)]
    # Cells past a request's q_len are garbage on purpose: the kernel must ignore them.
    mask = np.ones((len(trees), M, M), dtype=bool)
    for r, t in enumerate(trees):
        mask[r, : q_lens[r], : q_lens[r]] = _ancestor_or_self(TREES[t])
    return q_lens, seq, mask


def _dense_masked(q, k_cache, v_cache, qsl, seq_lens, table, mask, scale):
    """float64: row i of request r sees its cached context and the step rows mask[r, i]."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v_cache.shape[-1], dtype=torch.float64)
    G = H // k_cache.shape[1]
    for r in range(len(seq_lens)):
        n, t0, t1 = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        ctx = n - (t1 - t0)
        pos = np.arange(n)
        slots = torch.from_numpy(table[r, pos // BLOCK] * BLOCK + pos % BLOCK)
        k = k_cache[slots].double().repeat_interleave(G, dim=1)
        v = v_cache[slots].double().repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[t0:t1].double(), k) * scale
        allowed = np.zeros((t1 - t0, n), dtype=bool)
        allowed[:, :ctx] = True
        allowed[:, ctx:] = mask[r, : t1 - t0, : t1 - t0]
        s = s.masked_fill(~torch.from_numpy(allowed)[None], float("-inf"))
        out[t0:t1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


BATCHES = {
    # name: (trees, cached context lengths)
    "one_tree": (["deep_branch"], [37]),
    "mixed": (["fork_at_root", "deep_branch", "decode", "chain"], [0, 5, 70, 200]),
    "long_contexts": (["deep_branch", "fork_at_root"], [150, 9]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", ["gqa", "mla"])
def test_tree_kernel_matches_dense_masked_reference(batch, heads, dtype):
    from vllm import _custom_ops as ops

    trees, ctxs = BATCHES[batch]
    M = 10  # more rows than any request's query: the padding must be ignored
    q_lens, seq, mask = _tree_batch(trees, ctxs, M)
    H, Hkv, Dk, Dv = MLA if heads == "mla" else (8, 2, 32, 32)
    qsl, sl, table, slots = _layout(q_lens, seq, seed=1)
    q, k, v = _tensors(int(qsl[-1]), H, Hkv, Dk, Dv, slots, dtype, heads == "mla", seed=2)
    scale = Dk**-0.5
    ref = _dense_masked(q, k, v, qsl, sl, table, mask, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta_args = [torch.from_numpy(a) for a in (table, sl, qsl)]
    rows = torch.arange(len(sl))
    tree = torch.from_numpy(mask)
    for blocks_per_split in (0, 1, 3):  # auto, and forced key splits merged at the end
        out = torch.full((len(q), H, Dv), float("nan"), dtype=dtype)
        ops.paged_attention(
            out, q, k, v, *meta_args, rows, BLOCK, scale, blocks_per_split, tree_mask=tree
        )
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The tree rows really differ from causal attention (else the test could not fail).
    if any(t not in ("chain", "decode") for t in trees):
        causal = torch.empty_like(out)
        ops.paged_attention(causal, q, k, v, *meta_args, rows, BLOCK, scale, 0)
        assert not torch.allclose(causal.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_mask_is_bit_identical_to_the_causal_kernel(dtype):
    from vllm import _custom_ops as ops

    trees, ctxs = ["chain", "decode", "chain"], [3, 40, 130]
    q_lens, seq, _ = _tree_batch(trees, ctxs, 5)
    mask = np.tril(np.ones((3, 5, 5), dtype=bool))
    qsl, sl, table, slots = _layout(q_lens, seq, seed=3)
    q, k, v = _tensors(int(qsl[-1]), 8, 2, 32, 32, slots, dtype, False, seed=4)
    meta_args = [torch.from_numpy(a) for a in (table, sl, qsl)]
    rows = torch.arange(len(sl))
    for blocks_per_split in (0, 1):
        plain = torch.empty(len(q), 8, 32, dtype=dtype)
        ops.paged_attention(plain, q, k, v, *meta_args, rows, BLOCK, 0.2, blocks_per_split)
        masked = torch.empty_like(plain)
        for tm in (torch.from_numpy(mask), torch.from_numpy(mask.astype(np.int8))):
            ops.paged_attention(
                masked, q, k, v, *meta_args, rows, BLOCK, 0.2, blocks_per_split, tree_mask=tm
            )
            assert torch.equal(masked, plain)


def test_tree_row_that_sees_nothing_gets_zeros_and_bad_masks_are_refused():
    from vllm import _custom_ops as ops

    qsl, sl, table, slots = _layout([3], [3], seed=5)  # no cached context
    q, k, v = _tensors(3, 4, 2, 16, 16, slots, torch.float32, False, seed=6)
    mask = torch.from_numpy(_ancestor_or_self([-1, 0, 0]))
    mask[1] = False  # row 1 sees nothing at all
    meta_args = [torch.from_numpy(a) for a in (table, sl, qsl)]
    rows = torch.arange(1)
    out = torch.full((3, 4, 16), float("nan"))
    ops.paged_attention(out, q, k, v, *meta_args, rows, BLOCK, 0.25, 0, tree_mask=mask[None])
    assert torch.equal(out[1], torch.zeros(4, 16))
    assert torch.isfinite(out).all() and out[[0, 2]].abs().sum() > 0
    with pytest.raises(RuntimeError, match="more query tokens than the tree mask"):
        small = mask[None, :2, :2].clone()
        ops.paged_attention(out, q, k, v, *meta_args, rows, BLOCK, 0.25, 0, small)
    with pytest.raises(RuntimeError, match="tree_mask must be"):
        ops.paged_attention(out, q, k, v, *meta_args, rows, BLOCK, 0.25, 0, mask.float()[None])
