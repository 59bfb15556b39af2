# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Sparse MLA backends: the shared top-k buffer resolves lazily in every registered impl, the
sparse path equals a brute-force masked attention and (for short contexts) the dense path, and
the Triton kernel equals the torch reference (Triton's interpreter on CPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm.attention.backends.mla.sparse_common import (
    TOPK_PAD,
    SharedTopkIndicesBuffer,
    SparseMLACommonImpl,
)
from vllm.attention.backends.mla.torch_mla import MLADims, TorchMLAImpl
from vllm.attention.backends.registry import get_sparse_mla_impl_cls, sparse_mla_impl_names
from vllm.attention.backends.torch_paged import build_attn_metadata, padded_attention

H, NOPE, ROPE, V, RANK = 4, 16, 8, 16, 32
BLOCK_SIZE, NUM_BLOCKS = 4, 64
SCALE = (NOPE + ROPE) ** -0.5
DIMS = MLADims(H, NOPE, ROPE, V, RANK, SCALE)


def _impl(name: str, topk: int, indexer=None, buffer=None) -> SparseMLACommonImpl:
    cls = get_sparse_mla_impl_cls(name)
    return cls(DIMS, topk, indexer=indexer, topk_indices_buffer=buffer)


def _indexer(buffer: torch.Tensor):
    """Stands in for DeepseekV32Indexer: all an impl may use is its topk_indices_buffer."""
    return types.SimpleNamespace(topk_indices_buffer=buffer)


def _batch(q_lens: list[int], seq_lens: list[int], seed: int = 0):
    """Metadata of a step (requests in disjoint, shuffled blocks), queries and a random latent
    cache."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    table = _batch_table({"q_lens": q_lens}, seed)
    meta = build_attn_metadata(qsl, np.array(seq_lens), table, BLOCK_SIZE, "cpu")
    T = int(qsl[-1])
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(T, H, RANK + ROPE, generator=g)
    latent = torch.randn(NUM_BLOCKS * BLOCK_SIZE, 1, RANK + ROPE, generator=g)
    return meta, q, latent


def _random_selection(meta, topk: int, rows: int, seed: int = 0) -> torch.Tensor:
    """A buffer whose row t holds a random subset of token t's causal context (padded)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((rows, topk), TOPK_PAD, dtype=torch.int32)
    for grp in meta.groups:
        q_pos = grp.q_positions.reshape(-1)[grp.valid]
        for t, p in zip(grp.token_index.tolist(), q_pos.tolist()):
            n = min(topk, p + 1)
            buf[t, :n] = torch.randperm(p + 1, generator=g)[:n].to(torch.int32)
    return buf


def _brute_force(meta, q, latent, buf: torch.Tensor, topk: int) -> torch.Tensor:
    """Dense SDPA over the paged cache with a boolean mask scattered from the buffer (tokens
    whose context fits in topk see all of it)."""

    def mask_fn(g):
        rows, q_len = g.q_index.shape
        s_len = g.kv_slots.shape[1]
        allowed = torch.zeros(rows, q_len, s_len + 1, dtype=torch.bool)
        sel = torch.cat([buf.long(), torch.full((1, topk), TOPK_PAD)])[g.q_index]
        sel = torch.where(sel < 0, s_len, sel)
        allowed.scatter_(-1, sel, True)
        allowed = allowed[..., :s_len] | (g.q_positions < topk).unsqueeze(-1)
        return allowed.unsqueeze(1)

    return padded_attention(q, latent, latent[..., :RANK], meta, SCALE, mask_fn)


# ---- the shared top-k buffer ----------------------------------------------------------------


def test_impl_observes_indexer_buffer_repointed_after_construction() -> None:
    meta, q, latent = _batch([6, 1], [20, 15])
    topk = 4
    stale = _random_selection(meta, topk, 32, seed=1)
    live = _random_selection(meta, topk, 32, seed=2)
    indexer = _indexer(stale)
    impl = _impl("TORCH_MLA_SPARSE", topk, indexer=indexer)
    indexer.topk_indices_buffer = live  # what draft loading does, after the impls exist
    assert impl.topk_indices_buffer is live
    out = impl.attend_latent(q, latent, meta)
    torch.testing.assert_close(out, _brute_force(meta, q, latent, live, topk))
    assert not torch.allclose(out, _brute_force(meta, q, latent, stale, topk), atol=1e-3)


def test_explicit_assignment_supersedes_indexer() -> None:
    a, b, c = (torch.zeros(4, 2, dtype=torch.int32) for _ in range(3))
    indexer = _indexer(a)
    impl = _impl("TORCH_MLA_SPARSE", 2, indexer=indexer, buffer=b)
    assert impl.topk_indices_buffer is a  # an attached indexer wins over the constructor buffer
    impl.topk_indices_buffer = c
    assert impl.topk_indices_buffer is c
    indexer.topk_indices_buffer = torch.zeros(4, 2, dtype=torch.int32)
    assert impl.topk_indices_buffer is c  # detached from the indexer


@pytest.mark.parametrize("name", sparse_mla_impl_names())
def test_every_registered_sparse_impl_resolves_lazily(name: str) -> None:
    cls = get_sparse_mla_impl_cls(name)
    assert issubclass(cls, SharedTopkIndicesBuffer), f"{name}: {cls.__name__} lacks the mixin"
    first, second, explicit = (torch.zeros(4, 2, dtype=torch.int32) for _ in range(3))
    indexer = _indexer(first)
    impl = _impl(name, 2, indexer=indexer)
    assert impl.topk_indices_buffer is first
    indexer.topk_indices_buffer = second
    assert impl.topk_indices_buffer is second
    no_indexer = _impl(name, 2, buffer=explicit)
    assert no_indexer.topk_indices_buffer is explicit
    impl.topk_indices_buffer = explicit
    indexer.topk_indices_buffer = first
    assert impl.topk_indices_buffer is explicit


def test_registry_lists_both_backends_and_rejects_unknown() -> None:
    assert {"TORCH_MLA_SPARSE", "TRITON_MLA_SPARSE"} <= set(sparse_mla_impl_names())
    with pytest.raises(ValueError, match="NOPE"):
        get_sparse_mla_impl_cls("NOPE")


# ---- numerics -------------------------------------------------------------------------------

# A decode row, a 3-token verify row and a chunked prefill, all with contexts longer than topk.
LONG = dict(q_lens=[1, 3, 9], seq_lens=[23, 30, 19])


def test_torch_sparse_matches_brute_force() -> None:
    meta, q, latent = _batch(**LONG)
    topk = 6
    buf = _random_selection(meta, topk, 16)
    impl = _impl("TORCH_MLA_SPARSE", topk, buffer=buf)
    out = impl.attend_latent(q, latent, meta)
    torch.testing.assert_close(out, _brute_force(meta, q, latent, buf, topk))
    dense = TorchMLAImpl.attend_latent(impl, q, latent, meta)
    assert not torch.allclose(out, dense, atol=1e-3)  # the selection really restricts


def test_dense_path_matches_sparse_when_contexts_fit() -> None:
    meta, q, latent = _batch(q_lens=[1, 4, 7], seq_lens=[8, 6, 7])
    topk = 8
    # Garbage in the buffer: contexts within topk select everything whatever it holds.
    buf = torch.randint(-1, 3, (16, topk), dtype=torch.int32)
    impl = _impl("TORCH_MLA_SPARSE", topk, buffer=buf)
    dense = impl.attend_latent(q, latent, meta)
    impl.dense_when_short = False
    sparse = impl.attend_latent(q, latent, meta)
    torch.testing.assert_close(sparse, dense)


def _triton_vs_torch(device: str) -> None:
    """Triton sparse MLA against the torch reference on the same inputs (raises on mismatch)."""
    cases = [(LONG, 6, 0), (dict(q_lens=[2, 5], seq_lens=[70, 60]), 40, 3)]  # 40 > one block
    for shape, topk, seed in cases:
        meta, q, latent = _batch(**shape, seed=seed)
        buf = _random_selection(meta, topk, 16, seed=seed)
        ref = _impl("TORCH_MLA_SPARSE", topk, buffer=buf).attend_latent(q, latent, meta)
        if device != "cpu":
            meta = build_attn_metadata(
                meta.query_start_loc_np,
                meta.seq_lens_np,
                _batch_table(shape, seed),
                BLOCK_SIZE,
                device,
            )
            q, latent, buf = q.to(device), latent.to(device), buf.to(device)
        out = _impl("TRITON_MLA_SPARSE", topk, buffer=buf).attend_latent(q, latent, meta)
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


def _batch_table(shape: dict, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    n = len(shape["q_lens"])
    per_req = NUM_BLOCKS // n
    return torch.randperm(NUM_BLOCKS, generator=g).numpy()[: n * per_req].reshape(n, per_req)


def test_triton_matches_torch_reference() -> None:
    """On a GPU in this process; otherwise in Triton's CPU interpreter, in a subprocess
    (TRITON_INTERPRET must be set before triton is first imported)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        _triton_vs_torch("cuda")
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.attention.test_sparse_mla_backends import _triton_vs_torch as f; f('cpu')"
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
