# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The C++ CPU paged-attention kernel against a brute-force float64 attention per request, and
the backend's dispatch (the decode kernel for short queries, the prefill kernel for long ones)
against the torch reference path: decode, draft verification, chunked prefill, prefill,
GQA/MQA ratios, MLA's latent single-head form, odd block counts, key splits, bf16 and fp32."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from vllm import _custom_ops as ops
from vllm.attention.backends.torch_paged import (
    build_attn_metadata,
    padded_attention,
    paged_attention,
)

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        pytest.skip("VLLM_CPU_KERNELS=0: the torch reference path is forced")
    # A failed build must fail these tests, not skip them: the engine would silently be slow.
    assert ops.cpu_kernels_available(), "the CPU kernels did not build (see the log)"


def _layout(q_lens, seq_lens, seed=0):
    """Block tables with shuffled, non-contiguous physical blocks (plus unused spares)."""
    rng = np.random.default_rng(seed)
    q_lens, seq_lens = np.asarray(q_lens), np.asarray(seq_lens)
    nb = -(-seq_lens // BLOCK)
    perm = rng.permutation(int(nb.sum()) + 3)
    table = np.zeros((len(nb), int(nb.max()) + 2), dtype=np.int64)
    off = 0
    for r, n in enumerate(nb):
        table[r, :n] = perm[off : off + n]
        off += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return qsl, seq_lens.astype(np.int64), table, (int(perm.max()) + 1) * BLOCK


def _brute_force(q, k_cache, v_cache, qsl, seq_lens, table, scale):
    """Per request: gather its keys by block table, causal softmax in float64."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v_cache.shape[-1], dtype=torch.float64)
    G = H // k_cache.shape[1]
    for r in range(len(seq_lens)):
        n, t0, t1 = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        pos = np.arange(n)
        slots = torch.from_numpy(table[r, pos // BLOCK] * BLOCK + pos % BLOCK)
        k = k_cache[slots].double().repeat_interleave(G, dim=1)  # [n, H, Dk]
        v = v_cache[slots].double().repeat_interleave(G, dim=1)
        qr = q[t0:t1].double()  # [ql, H, Dk]
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        q_pos = n - (t1 - t0) + torch.arange(t1 - t0)
        s = s.masked_fill(torch.arange(n)[None, :] > q_pos[:, None], float("-inf"))
        out[t0:t1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def _tensors(T, H, Hkv, Dk, Dv, slots, dtype, mla, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dk, generator=g).to(dtype)
    if mla:  # one latent row per token: keys = the row, values = its first Dv channels
        latent = torch.randn(slots, 1, Dk, generator=g).to(dtype)
        return q, latent, latent[..., :Dv]
    k = torch.randn(slots, Hkv, Dk, generator=g).to(dtype)
    v = torch.randn(slots, Hkv, Dv, generator=g).to(dtype)
    return q, k, v


CASES = {
    # name: (q_lens, seq_lens)
    "decode": ([1, 1, 1, 1, 1], [1, 16, 17, 47, 130]),
    "verify": ([3, 4, 2], [3, 40, 65]),
    "prefill": ([5, 33], [5, 33]),
    "chunked_prefill": ([16, 20], [48, 21]),
    "mixed": ([1, 4, 24, 1], [200, 19, 24, 1]),
}
HEADS = {
    "mha": (4, 4, 32, 32),
    "gqa3": (9, 3, 64, 64),
    "gqa4": (8, 2, 16, 16),
    "mqa": (6, 1, 32, 32),
    "gqa2_d128": (4, 2, 128, 128),  # head sizes 32 / 64 / 128 take the chunked path
}
MLA = (8, 1, 48, 32)  # 8 heads over one latent head: rank 32 + rope 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [*HEADS, "mla"])
def test_kernel_matches_brute_force(case, heads, dtype):
    q_lens, seq_lens = CASES[case]
    H, Hkv, Dk, Dv = MLA if heads == "mla" else HEADS[heads]
    qsl, sl, table, slots = _layout(q_lens, seq_lens)
    q, k, v = _tensors(int(qsl[-1]), H, Hkv, Dk, Dv, slots, dtype, heads == "mla")
    scale = Dk**-0.5
    ref = _brute_force(q, k, v, qsl, sl, table, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    meta_args = [torch.from_numpy(a) for a in (table, sl, qsl)]
    rows = torch.arange(len(sl))
    for blocks_per_split in (0, 1, 3):  # auto, and forced key splits merged at the end
        out = torch.full((len(q), H, Dv), float("nan"), dtype=dtype)
        ops.paged_attention(out, q, k, v, *meta_args, rows, BLOCK, scale, blocks_per_split)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "mqa", "gqa2_d128", "gqa8"])
def test_a_row_is_bit_identical_whatever_shares_its_call(heads, dtype):
    """Lossless speculation rests on this: a query token's output is the same bits whether it
    is decoded alone (q_len 1), verified among a request's other new tokens (q_len M), or
    computed beside other requests. The kernel tiles a kv group's heads together; each head's
    arithmetic must not depend on its tile-mates or on the rows around it (key splits fixed:
    the automatic split follows the batch, so is not part of this guarantee)."""
    H, Hkv, Dk, Dv = (16, 2, 64, 64) if heads == "gqa8" else HEADS[heads]
    M, ctx, other = 6, 37, (3, 90)  # a verify of M tokens; another request beside it
    q_lens = [M, other[0]]
    qsl, sl, table, slots = _layout(q_lens, [ctx + M, other[1]], seed=7)
    q, k, v = _tensors(int(qsl[-1]), H, Hkv, Dk, Dv, slots, dtype, False, seed=8)
    scale = Dk**-0.5
    together = torch.empty(len(q), H, Dv, dtype=dtype)
    meta = [torch.from_numpy(a) for a in (table, sl, qsl)]
    ops.paged_attention(together, q, k, v, *meta, torch.arange(2), BLOCK, scale, 1)
    for i in range(M):  # token i of request 0 decoded alone: q_len 1 at its own position
        one = torch.empty(1, H, Dv, dtype=dtype)
        alone = [torch.from_numpy(table[:1]), torch.tensor([ctx + i + 1]), torch.tensor([0, 1])]
        ops.paged_attention(one, q[i : i + 1], k, v, *alone, torch.arange(1), BLOCK, scale, 1)
        assert torch.equal(one[0], together[i]), f"token {i} differs decoded alone"
    first = torch.empty(M, H, Dv, dtype=dtype)  # request 0's verify without the other request
    alone = [torch.from_numpy(table[:1]), torch.from_numpy(sl[:1]), torch.tensor([0, M])]
    ops.paged_attention(first, q[:M], k, v, *alone, torch.arange(1), BLOCK, scale, 1)
    assert torch.equal(first, together[:M])


def test_kernel_computes_only_the_given_rows():
    qsl, sl, table, slots = _layout([1, 3, 1], [20, 9, 70])
    q, k, v = _tensors(int(qsl[-1]), 8, 2, 16, 16, slots, torch.float32, False)
    ref = _brute_force(q, k, v, qsl, sl, table, 0.25)
    out = torch.full((len(q), 8, 16), 7.0)
    rows = torch.tensor([0, 2])
    meta_args = [torch.from_numpy(a) for a in (table, sl, qsl)]
    ops.paged_attention(out, q, k, v, *meta_args, rows, BLOCK, 0.25, 0)
    torch.testing.assert_close(out[[0, 4]].double(), ref[[0, 4]], atol=1e-5, rtol=1e-5)
    assert (out[1:4] == 7.0).all()  # request 1's tokens untouched


def test_kernel_rejects_a_short_block_table():
    qsl, sl, table, slots = _layout([1], [40])
    q, k, v = _tensors(1, 4, 4, 8, 8, slots, torch.float32, False)
    out = torch.empty(1, 4, 8)
    short = torch.from_numpy(table[:, :2].copy())  # 40 tokens need 3 blocks of 16
    with pytest.raises(RuntimeError, match="block table"):
        ops.paged_attention(
            out, q, k, v, short, torch.from_numpy(sl), torch.from_numpy(qsl),
            torch.tensor([0]), BLOCK, 1.0, 0,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", ["gqa3", "mla"])
@pytest.mark.parametrize("short_query_len", [1, 4])
def test_backend_dispatch_matches_torch_reference(heads, dtype, short_query_len):
    """paged_attention (decode kernel for short queries + prefill kernel for long ones) ==
    padded_attention."""
    q_lens, seq_lens = [1, 4, 24, 1, 3, 40], [200, 19, 24, 1, 50, 41]
    H, Hkv, Dk, Dv = MLA if heads == "mla" else HEADS[heads]
    qsl, sl, table, slots = _layout(q_lens, seq_lens, seed=1)
    q, k, v = _tensors(int(qsl[-1]), H, Hkv, Dk, Dv, slots, dtype, heads == "mla", seed=1)
    meta = build_attn_metadata(qsl, sl, table, BLOCK, "cpu", short_query_len=short_query_len)
    out = paged_attention(q, k, v, meta, Dk**-0.5)
    ref = padded_attention(q, k, v, meta, Dk**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_env_switch_forces_the_reference_path(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KERNELS", "0")
    assert ops.cpu_kernels_available.__wrapped__() is False


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    (tmp_path / "torch_bindings.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(ops, "CSRC", tmp_path)
    monkeypatch.setenv("VLLM_CPU_KERNELS_BUILD_DIR", str(tmp_path / "build"))
    logger = logging.getLogger("vllm")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert ops.cpu_kernels_available.__wrapped__() is False
    assert any("could not build the CPU kernels" in r.getMessage() for r in caplog.records)
