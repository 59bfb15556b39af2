# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The CPU prefill attention kernel (csrc/cpu/prefill_attention.cpp) against a dense float64
attention per request, on every instruction-set path this CPU can run (forced by
VLLM_CPU_PREFILL_ATTN_ISA): fresh prefills and chunked prefill over a cached context, block
and tile boundaries, GQA / MQA ratios and MLA's latent single-head form, sliding windows, fp32
and bf16; and the torch path's mask-free SDPA for fresh prefills against the padded groups."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from vllm import _custom_ops as ops
from vllm.attention.backends import torch_paged
from vllm.attention.backends.torch_paged import build_attn_metadata, padded_attention


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        pytest.skip("VLLM_CPU_KERNELS=0: the torch reference path is forced")
    assert ops.cpu_kernels_available(), "the CPU kernels did not build (see the log)"


@pytest.fixture(params=["portable", "avx2", "avx512", "avx512bf16"])
def isa(request, monkeypatch):
    """Each instruction-set path this CPU can run, forced by VLLM_CPU_PREFILL_ATTN_ISA."""
    if request.param not in ops.prefill_attention_isas_available():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    monkeypatch.setenv("VLLM_CPU_PREFILL_ATTN_ISA", request.param)
    ops.prefill_attention_isa.cache_clear()
    assert ops.prefill_attention_isa() == ops.LINEAR_ISAS[request.param]
    yield request.param
    ops.prefill_attention_isa.cache_clear()


def _layout(q_lens, seq_lens, block_size, seed=0):
    """Block tables with shuffled, non-contiguous physical blocks (plus unused spares)."""
    rng = np.random.default_rng(seed)
    q_lens, seq_lens = np.asarray(q_lens), np.asarray(seq_lens)
    nb = -(-seq_lens // block_size)
    perm = rng.permutation(int(nb.sum()) + 3)
    table = np.zeros((len(nb), int(nb.max()) + 2), dtype=np.int64)
    off = 0
    for r, n in enumerate(nb):
        table[r, :n] = perm[off : off + n]
        off += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return qsl, seq_lens.astype(np.int64), table, (int(perm.max()) + 1) * block_size


def _dense(q, k_cache, v_cache, qsl, seq_lens, table, block_size, scale, window=0):
    """Per request: its keys gathered by block table into a dense [n, H, D] tensor, a full
    score matrix in float64 with the causal (and window) mask built from positions."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v_cache.shape[-1], dtype=torch.float64)
    G = H // k_cache.shape[1]
    for r in range(len(seq_lens)):
        n, t0, t1 = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        pos = np.arange(n)
        slots = torch.from_numpy(table[r, pos // block_size] * block_size + pos % block_size)
        k = k_cache[slots].double().repeat_interleave(G, dim=1)
        v = v_cache[slots].double().repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[t0:t1].double(), k) * scale
        q_pos = (n - (t1 - t0) + torch.arange(t1 - t0))[:, None]
        k_pos = torch.arange(n)[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= q_pos - k_pos >= window
        s = s.masked_fill(hidden, float("-inf"))
        out[t0:t1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def _tensors(T, H, Hkv, Dk, Dv, slots, dtype, mla, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dk, generator=g).to(dtype)
    if mla:  # one latent row per token: keys = the row, values = its first Dv channels
        latent = torch.randn(slots, 1, Dk, generator=g).to(dtype)
        return q, latent, latent[..., :Dv]
    # Spread-out logits (x2): the softmax is far from uniform, so a wrong mask shows.
    k = (2 * torch.randn(slots, Hkv, Dk, generator=g)).to(dtype)
    v = torch.randn(slots, Hkv, Dv, generator=g).to(dtype)
    return q, k, v


def _run(q_lens, seq_lens, heads, dtype, block_size=16, window=0, seed=0):
    H, Hkv, Dk, Dv = heads
    mla = Hkv == 0
    qsl, sl, table, slots = _layout(q_lens, seq_lens, block_size, seed)
    q, k, v = _tensors(int(qsl[-1]), H, max(Hkv, 1), Dk, Dv, slots, dtype, mla, seed)
    scale = Dk**-0.5
    ref = _dense(q, k, v, qsl, sl, table, block_size, scale, window)
    out = torch.full((len(q), H, Dv), float("nan"), dtype=dtype)
    meta = [torch.from_numpy(a) for a in (table, sl, qsl)]
    ops.prefill_attention(
        out, q, k, v, *meta, torch.arange(len(sl)), block_size, scale, sliding_window=window
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


HEADS = {
    "mha": (4, 4, 32, 32),
    "gqa3_smollm2": (9, 3, 64, 64),
    "gqa4": (8, 2, 16, 16),
    "mqa": (6, 1, 40, 24),  # head dims off the vector widths (padded V columns)
    "mla": (8, 0, 48, 32),  # 8 heads over one latent row: rank 32 + rope 16
}
CASES = {
    # name: (q_lens, seq_lens)
    "fresh": ([5, 33, 1], [5, 33, 1]),
    "chunk_over_cache": ([16, 20, 7], [48, 21, 200]),
    "long": ([150], [150]),  # several query and key tiles
    "long_chunk": ([97], [260]),  # a chunk starting mid-tile, mid-block
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_matches_dense_reference(isa, heads, case, dtype):
    _run(*CASES[case], HEADS[heads], dtype)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_block_and_tile_boundaries(isa, block_size):
    """Contexts and queries one short of, at and one past a block / key-tile (48 / 96) /
    query-tile (96 rows) multiple: masks and partial tiles at every edge."""
    edges = sorted({n + d for n in (block_size, 48, 96, 192) for d in (-1, 0, 1) if n + d > 1})
    q_lens = [min(n, 1 + n // 2) for n in edges]
    _run(q_lens, edges, HEADS["gqa3_smollm2"], torch.float32, block_size=block_size)
    _run(edges, edges, HEADS["mha"], torch.float32, block_size=block_size, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 48, 100])
def test_sliding_window(isa, window, dtype):
    """A query at p sees keys in (p - window, p]: fresh prefills and chunks over a context
    longer than the window (key tiles before it skipped, partial ones masked)."""
    _run([60, 33, 130], [60, 140, 300], HEADS["gqa3_smollm2"], dtype, window=window)


def test_only_the_given_requests_are_written():
    qsl, sl, table, slots = _layout([3, 20, 12], [9, 20, 40], 16)
    q, k, v = _tensors(int(qsl[-1]), 4, 2, 16, 16, slots, torch.float32, False)
    out = torch.full((len(q), 4, 16), 7.0)
    meta = [torch.from_numpy(a) for a in (table, sl, qsl)]
    ops.prefill_attention(out, q, k, v, *meta, torch.tensor([1]), 16, 0.25)
    ref = _dense(q, k, v, qsl, sl, table, 16, 0.25)
    torch.testing.assert_close(out[3:23].double(), ref[3:23], atol=2e-5, rtol=2e-5)
    assert (out[:3] == 7.0).all() and (out[23:] == 7.0).all()


def test_unknown_isa_is_a_value_error_naming_the_variable(monkeypatch):
    missing = [
        n
        for n in ("avx512bf16", "avx512", "avx2")
        if n not in ops.prefill_attention_isas_available()
    ]
    if not missing:
        pytest.skip("this CPU runs every path")
    monkeypatch.setenv("VLLM_CPU_PREFILL_ATTN_ISA", missing[0])
    ops.prefill_attention_isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="VLLM_CPU_PREFILL_ATTN_ISA"):
            ops.prefill_attention_isa()
    finally:
        ops.prefill_attention_isa.cache_clear()


def test_torch_path_mask_free_prefill_matches_padded_groups(monkeypatch):
    """Without the kernels: fresh prefills run SDPA's causal path on their own keys, the rest
    the padded groups; the result equals the padded groups for every request."""
    block = 16
    q_lens, seq_lens = [1, 40, 3, 25, 64], [30, 40, 3, 90, 64]  # decode, fresh, short, chunk
    qsl, sl, table, slots = _layout(q_lens, seq_lens, block)
    q, k, v = _tensors(int(qsl[-1]), 9, 3, 64, 64, slots, torch.float32, False)
    pos = np.concatenate([np.arange(s - n, s) for n, s in zip(q_lens, seq_lens)])
    meta = build_attn_metadata(qsl, sl, table, block, torch.device("cpu"), positions=pos)
    monkeypatch.setattr(torch_paged, "use_cpu_kernel", lambda *a: False)
    out = torch_paged.paged_attention(q, k, v, meta, 0.125)
    ref = padded_attention(q, k, v, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    dense = _dense(q, k, v, qsl, sl, table, block, 0.125)
    torch.testing.assert_close(out.double(), dense, atol=2e-5, rtol=2e-5)
