# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Every Triton kernel of the CUDA path against its torch reference: paged attention (decode,
verify and prefill rows, GQA ratios, tree masks, sliding window), dense MLA over the latent
cache, the sparse top-k MLA, the KV-cache write, fused RMSNorm + residual, rotary (plain, GPT-J
and M-RoPE) and the rejection sampler's accept step - fp32 and bf16, odd sizes, sequences that
end on, before and after block and tile boundaries.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set per test: the kernels
are jitted at launch); on a GPU (`-m cuda` runs only these, see benchmarks/gpu_check.py) the
same cases run compiled, on CUDA tensors. Shapes are tiny: the interpreter runs a kernel's
Python once per program."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _tree(num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """A random draft tree over num_rows rows (row 0 the root, each later row's parent an
    earlier row): [num_rows, num_rows] ancestor-or-self mask."""
    parent = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, num_rows)]
    mask = torch.zeros(num_rows, num_rows, dtype=torch.bool)
    for i in range(num_rows):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def _paged_batch(q_lens, seq_lens, block_size, seed):
    """query_start_loc, seq_lens and a block table whose requests hold shuffled, disjoint
    blocks (so a wrong block lookup reads another request's keys)."""
    g = torch.Generator().manual_seed(seed)
    R = len(q_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = R * max_blocks + 3
    table = torch.randperm(num_blocks, generator=g)[: R * max_blocks].view(R, max_blocks)
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int64)
    return qsl, torch.tensor(seq_lens, dtype=torch.int64), table.to(torch.int32), num_blocks, g


# ---- paged attention ------------------------------------------------------------------------

# (q_lens, seq_lens, block_size): decode rows, verify rows (1 + K), a prefill chunk longer than
# one 16- / 64-row tile, contexts ending exactly on / one past a block and a 32-key tile.
PAGED_CASES = [
    ([1, 1, 1], [1, 32, 33], 16),
    ([1, 4, 3], [23, 30, 16], 3),
    ([9, 2], [19, 64], 5),
    ([70], [75], 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PAGED_CASES)))
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
def test_paged_attention(case, heads, dtype) -> None:
    from vllm.attention.ops.triton_paged_attention import (
        paged_attention_reference,
        triton_paged_attention,
    )

    q_lens, seq_lens, bs = PAGED_CASES[case]
    if heads != (6, 2) and case >= 2:
        pytest.skip("long rows once per dtype (the GQA ratio does not change the row tiling)")
    H, hkv = heads
    qsl, sl, table, nblk, g = _paged_batch(q_lens, seq_lens, bs, seed=case)
    D = 24  # not a power of two: masked channels
    q = torch.randn(int(qsl[-1]), H, D, generator=g).to(dtype)
    kc = torch.randn(nblk * bs, hkv, D, generator=g).to(dtype)
    vc = torch.randn(nblk * bs, hkv, D, generator=g).to(dtype)
    ref = paged_attention_reference(q, kc, vc, table, sl, qsl, 0.2, bs)
    args = [t.to(DEVICE) for t in (q, kc, vc, table, sl, qsl)]
    out = triton_paged_attention(*args, scale=0.2, block_size=bs, max_query_len=max(q_lens))
    torch.testing.assert_close(out.cpu().float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_tree_mask(dtype) -> None:
    """Verify rows of draft trees (random trees, 1 + 6 rows; one request with fewer rows than
    the mask's width): each row sees the cached context and its ancestors only."""
    from vllm.attention.ops.triton_paged_attention import (
        paged_attention_reference,
        triton_paged_attention,
    )

    q_lens, seq_lens, bs = [7, 5, 7], [20, 5, 40], 4
    qsl, sl, table, nblk, g = _paged_batch(q_lens, seq_lens, bs, seed=7)
    tree = torch.stack([_tree(7, g) for _ in q_lens])
    H, hkv, D, dv = 4, 2, 16, 12  # values narrower than keys
    q = torch.randn(int(qsl[-1]), H, D, generator=g).to(dtype)
    kc = torch.randn(nblk * bs, hkv, D, generator=g).to(dtype)
    vc = torch.randn(nblk * bs, hkv, dv, generator=g).to(dtype)
    ref = paged_attention_reference(q, kc, vc, table, sl, qsl, 0.3, bs, tree_mask=tree)
    causal = paged_attention_reference(q, kc, vc, table, sl, qsl, 0.3, bs)
    assert not torch.allclose(ref.float(), causal.float(), atol=1e-3)  # the tree matters
    args = [t.to(DEVICE) for t in (q, kc, vc, table, sl, qsl)]
    out = triton_paged_attention(
        *args, scale=0.3, block_size=bs, max_query_len=7, tree_mask=tree.to(DEVICE)
    )
    torch.testing.assert_close(out.cpu().float(), ref.float(), **_tol(dtype))
    # A chain (lower triangle) is plain causal attention.
    chain = torch.ones(3, 7, 7, dtype=torch.bool).tril()
    out = triton_paged_attention(
        *args, scale=0.3, block_size=bs, max_query_len=7, tree_mask=chain.to(DEVICE)
    )
    torch.testing.assert_close(out.cpu().float(), causal.float(), **_tol(dtype))


@pytest.mark.parametrize("window", [1, 5, 40])
def test_paged_attention_sliding_window(window) -> None:
    from vllm.attention.ops.triton_paged_attention import (
        paged_attention_reference,
        triton_paged_attention,
    )

    q_lens, seq_lens, bs = [1, 3, 20], [50, 37, 45], 4
    qsl, sl, table, nblk, g = _paged_batch(q_lens, seq_lens, bs, seed=window)
    q = torch.randn(int(qsl[-1]), 4, 16, generator=g)
    kc = torch.randn(nblk * bs, 2, 16, generator=g)
    vc = torch.randn(nblk * bs, 2, 16, generator=g)
    ref = paged_attention_reference(q, kc, vc, table, sl, qsl, 0.25, bs, sliding_window=window)
    args = [t.to(DEVICE) for t in (q, kc, vc, table, sl, qsl)]
    out = triton_paged_attention(
        *args, scale=0.25, block_size=bs, max_query_len=20, sliding_window=window
    )
    torch.testing.assert_close(out.cpu(), ref, **_tol(torch.float32))


def test_paged_attention_padding_rows_and_empty_requests() -> None:
    """A captured step's layout: rows past the real tokens and request entries past the real
    requests (query_start_loc repeating the total, seq_lens 0) are left untouched."""
    from vllm.attention.ops.triton_paged_attention import (
        paged_attention_reference,
        triton_paged_attention,
    )

    qsl, sl, table, nblk, g = _paged_batch([1, 2], [9, 6], 4, seed=3)
    T_pad, R_pad = 8, 5
    qsl_pad = torch.cat([qsl, qsl[-1:].repeat(R_pad - 2)])
    sl_pad = torch.cat([sl, torch.zeros(R_pad - 2, dtype=torch.int64)])
    table_pad = torch.cat([table, torch.zeros(R_pad - 2, table.shape[1], dtype=torch.int32)])
    q = torch.randn(T_pad, 2, 16, generator=g)
    kc = torch.randn(nblk * 4, 1, 16, generator=g)
    vc = torch.randn(nblk * 4, 1, 16, generator=g)
    out = torch.full((T_pad, 2, 16), 7.0)
    ref = paged_attention_reference(q[:3], kc, vc, table, sl, qsl, 0.25, 4)
    args = [t.to(DEVICE) for t in (q, kc, vc, table_pad, sl_pad, qsl_pad)]
    res = triton_paged_attention(
        *args, scale=0.25, block_size=4, max_query_len=2, out=out.to(DEVICE)
    ).cpu()
    torch.testing.assert_close(res[:3], ref, **_tol(torch.float32))
    assert (res[3:] == 7.0).all()


def test_paged_attention_rejects_bad_input() -> None:
    from vllm.attention.ops.triton_paged_attention import triton_paged_attention

    qsl, sl, table, nblk, _ = _paged_batch([2], [5], 4, seed=0)
    q, kc = torch.zeros(2, 4, 16), torch.zeros(nblk * 4, 3, 16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        triton_paged_attention(q, kc, kc, table, sl, qsl, 1.0, 4, 2)
    kc = torch.zeros(nblk * 4, 2, 16)
    with pytest.raises(ValueError, match="tree_mask"):
        triton_paged_attention(
            q, kc, kc, table, sl, qsl, 1.0, 4, 2, tree_mask=torch.ones(1, 1, 1, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="sliding_window"):
        triton_paged_attention(q, kc, kc, table, sl, qsl, 1.0, 4, 2, sliding_window=0)


# ---- MLA ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_mla_attention(dtype, tree) -> None:
    """Dense MLA decode / verify / prefill rows over the paged latent cache (rank and rope
    not powers of two; more heads than one 16-head block)."""
    from vllm.attention.ops.triton_mla_attention import (
        mla_attention_reference,
        triton_mla_attention,
    )

    q_lens, seq_lens, bs = ([1, 4, 9], [33, 20, 9], 4) if not tree else ([4, 3], [30, 8], 4)
    qsl, sl, table, nblk, g = _paged_batch(q_lens, seq_lens, bs, seed=11)
    H, rank, rope = 18, 40, 12
    q = torch.randn(int(qsl[-1]), H, rank + rope, generator=g).to(dtype)
    latent = torch.randn(nblk * bs, 1, rank + rope, generator=g).to(dtype)
    mask = torch.stack([_tree(4, g) for _ in q_lens]) if tree else None
    ref = mla_attention_reference(q, latent, table, sl, qsl, 0.15, bs, rank, tree_mask=mask)
    args = [t.to(DEVICE) for t in (q, latent, table, sl, qsl)]
    out = triton_mla_attention(
        *args,
        scale=0.15,
        block_size=bs,
        kv_lora_rank=rank,
        max_query_len=max(q_lens),
        tree_mask=None if mask is None else mask.to(DEVICE),
    )
    torch.testing.assert_close(out.cpu().float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla(dtype) -> None:
    """The existing sparse top-k kernel (DeepSeek-V3.2) against the torch sparse reference:
    selections longer than one 32-row tile, unused (-1) slots, bf16."""
    from vllm.attention.backends.mla.torch_mla import MLADims
    from vllm.attention.backends.mla.torch_mla_sparse import TorchMLASparseImpl
    from vllm.attention.backends.mla.triton_mla_sparse import TritonMLASparseImpl

    g = torch.Generator().manual_seed(5)
    H, rank, rope, T, topk, slots = 5, 24, 8, 6, 40, 90
    dims = MLADims(H, 16, rope, 16, rank, 0.2)
    q = torch.randn(T, H, rank + rope, generator=g).to(dtype)
    latent = torch.randn(slots, 1, rank + rope, generator=g).to(dtype)
    sel = torch.stack([torch.randperm(slots, generator=g)[:topk] for _ in range(T)])
    sel[:, 33:] = -1
    sel[0, 1:] = -1
    ref = TorchMLASparseImpl(dims, topk).sparse_attend(q, latent, sel)
    out = TritonMLASparseImpl(dims, topk).sparse_attend(
        q.to(DEVICE), latent.to(DEVICE), sel.to(DEVICE)
    )
    torch.testing.assert_close(out.cpu().float(), ref.float(), **_tol(dtype))


# ---- KV-cache write -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(dtype) -> None:
    from vllm.attention.ops.triton_kv_cache import (
        triton_write_kv_cache,
        triton_write_mla_cache,
        write_slots_reference,
    )

    g = torch.Generator().manual_seed(2)
    T, hkv, D, slots = 7, 3, 20, 50
    key = torch.randn(T, hkv, D, generator=g).to(dtype)
    value = torch.randn(T, hkv, D, generator=g)  # fp32 into a cache of `dtype`: cast
    slot_mapping = torch.randperm(slots, generator=g)[:T]
    slot_mapping[4] = -1  # a padding token
    cache = torch.randn(2, slots, hkv, D, generator=g).to(dtype)
    ref = cache.clone()
    write_slots_reference(key, value, ref[0], ref[1], slot_mapping)
    out = cache.to(DEVICE)
    triton_write_kv_cache(key.to(DEVICE), value.to(DEVICE), out, slot_mapping.to(DEVICE))
    assert torch.equal(out.cpu()[0], ref[0])
    # The cast: Triton's interpreter truncates fp32 -> bf16 where GPUs round to nearest.
    torch.testing.assert_close(out.cpu()[1], ref[1], atol=0, rtol=1e-2)

    rank, rope = 36, 12
    kv_c = torch.randn(T, rank, generator=g).to(dtype)
    k_pe = torch.randn(T, 1, rope, generator=g).to(dtype)[:, 0]  # a strided view
    latent = torch.randn(slots, 1, rank + rope, generator=g).to(dtype)
    ref = latent.clone()
    write_slots_reference(kv_c, k_pe, ref[:, 0, :rank], ref[:, 0, rank:], slot_mapping)
    out = latent.to(DEVICE)
    triton_write_mla_cache(kv_c.to(DEVICE), k_pe.to(DEVICE), out, slot_mapping.to(DEVICE))
    assert torch.equal(out.cpu(), ref)


# ---- RMSNorm, rotary ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual) -> None:
    from vllm.model_executor.layers.ops.triton_rms_norm import rms_norm_reference, triton_rms_norm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 2 * 37, generator=g) * 3).to(dtype)[:, ::2]  # strided rows, odd width
    x = x.contiguous() if with_residual else x
    w = torch.randn(37, generator=g).to(dtype)
    res = torch.randn(5, 37, generator=g).to(dtype) if with_residual else None
    ref = rms_norm_reference(x, w, 1e-5, res)
    out = triton_rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5, None if res is None else res.to(DEVICE))
    if with_residual:
        assert isinstance(out, tuple) and isinstance(ref, tuple)
        torch.testing.assert_close(out[0].cpu(), ref[0], **_tol(dtype))
        # The residual sum: one rounding (exact in fp32; the interpreter truncates to bf16).
        torch.testing.assert_close(out[1].cpu(), ref[1], atol=0, rtol=1e-2)
    else:
        assert isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
        torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj", "partial", "mrope"])
def test_rotary(dtype, style, monkeypatch) -> None:
    """The kernel against the reference, and the reference against the layers' own torch path
    (RotaryEmbedding._rotate / MRotaryEmbedding), so both describe the same rotation."""
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)  # the layers' torch path
    from vllm.model_executor.layers.ops.triton_rotary import rotary_reference, triton_rotary
    from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding, RotaryEmbedding

    g = torch.Generator().manual_seed(4)
    T, hq, hk, D = 6, 3, 1, 20
    rot = 12 if style == "partial" else D
    neox = style != "gptj"
    if style == "mrope":
        layer: RotaryEmbedding = MRotaryEmbedding(D, rot, 64, 10000.0, [2, 2, 1])
        positions = torch.randint(0, 64, (3, T), generator=g)
        axis = layer.axis
    else:
        layer = RotaryEmbedding(D, rot, 64, 10000.0, is_neox_style=neox)
        positions = torch.randint(0, 64, (T,), generator=g)
        axis = None
    q = torch.randn(T, hq * D, generator=g).to(dtype)
    k = torch.randn(T, hk, D, generator=g).to(dtype)
    ref = rotary_reference(positions, q, k, layer._cos, layer._sin, D, rot, neox, axis)
    if style == "mrope":
        torch_path = layer(positions, q, k)
    else:
        cos = layer._cos[positions].unsqueeze(1)
        sin = layer._sin[positions].unsqueeze(1)
        torch_path = (
            layer._rotate(q.view(T, hq, D), cos, sin).view(q.shape),
            layer._rotate(k, cos, sin),
        )
    for a, b in zip(ref, torch_path):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    dev = lambda t: None if t is None else t.to(DEVICE)
    out = triton_rotary(
        dev(positions), dev(q), dev(k), dev(layer._cos), dev(layer._sin), D, rot, neox, dev(axis)
    )
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a.cpu(), b, **_tol(dtype))


# ---- rejection sampler ----------------------------------------------------------------------


def test_rejection_accept_step() -> None:
    """Requests with all drafts accepted, none, some, no drafts, no logits rows (a prefill
    chunk), against the host step the engine runs (rejection_sample_tokens)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import rejection_sample_tokens
    from vllm.v1.worker.gpu.spec_decode.triton_rejection import triton_rejection_sample

    rng = np.random.default_rng(0)
    rows = [4, 4, 4, 1, 0, 3, 4]
    cu = np.concatenate([[0], np.cumsum(rows)])
    target = rng.integers(0, 5, cu[-1])
    drafts = target.copy()
    drafts[cu[1] + 0] = (target[cu[1]] + 1) % 5  # request 1: first draft rejected
    drafts[cu[2] + 2] = (target[cu[2] + 2] + 1) % 5  # request 2: third draft rejected
    drafts[cu[5] + 1] = (target[cu[5] + 1] + 1) % 5  # request 5: second rejected
    drafts[cu[1:] - 1] = -7  # a request's last row verifies nothing
    ref_s, ref_n = rejection_sample_tokens(target, cu, drafts, width=4)
    args = [torch.from_numpy(a).to(DEVICE) for a in (target, cu, drafts)]
    out_s, out_n = triton_rejection_sample(args[0], args[1], args[2], width=4)
    assert out_n.cpu().tolist() == ref_n.tolist() == [4, 1, 3, 1, 0, 2, 4]
    assert out_s.cpu().numpy().tolist() == ref_s.tolist()


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter")
def test_interpreter_switched_on_after_triton_was_imported() -> None:
    """A process that imported triton in compiled mode and turns the interpreter on later (a
    test run, the engine forced onto Triton on CPU) still runs kernels that call Triton's @jit
    library (tl.sum in RMSNorm, tl.max / tl.zeros in attention)."""
    import os
    import subprocess
    import sys

    code = (
        "import os, torch, triton, triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from vllm.model_executor.layers.ops.triton_rms_norm import *\n"
        "x, w = torch.randn(3, 8), torch.randn(8)\n"
        "torch.testing.assert_close(triton_rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
