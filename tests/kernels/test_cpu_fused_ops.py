# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The fused CPU RMSNorm(+residual) and rotary-embedding ops against the torch arithmetic of the
RMSNorm / RotaryEmbedding modules (which the modules run where the ops cannot)."""

from __future__ import annotations

import os

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        pytest.skip("VLLM_CPU_KERNELS=0: the torch reference path is forced")
    assert ops.cpu_kernels_available(), "the CPU kernels did not build (see the log)"


def _torch_norm(m: RMSNorm, x, residual=None):
    if residual is None:
        return m._norm(x)
    s = x + residual
    return m._norm(s), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 4, 48)])
def test_rms_norm_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(0)
    m = RMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    with torch.inference_mode():
        torch.testing.assert_close(ops.rms_norm(x, m.weight, 1e-5), _torch_norm(m, x), **tol)
        out, s = ops.add_rms_norm(x, res, m.weight, 1e-5)
        ref_out, ref_s = _torch_norm(m, x, res)
        assert torch.equal(s, ref_s)  # the residual stream itself is exact
        torch.testing.assert_close(out, ref_out, **tol)
        # The module takes the fused path (its torch arithmetic is not called) and agrees.
        m._norm = _no_torch_path
        torch.testing.assert_close(m(x, res)[0], ref_out, **tol)
    x0, r0 = x.clone(), res.clone()
    ops.add_rms_norm(x, res, m.weight, 1e-5)
    assert torch.equal(x, x0) and torch.equal(res, r0)  # inputs untouched (EAGLE3 taps keep them)


def test_bf16_residual_sum_rounds_as_torch_at_ties_and_specials():
    """The kernel rounds fp32 to bf16 with integer arithmetic (it vectorizes; c10's conversion
    does not): sums landing exactly half-way between two bf16 values (ties to even, both
    ways), overflow to inf, subnormals and signed zeros round bit for bit as torch's bf16
    add, and NaN stays NaN."""
    lo = torch.tensor([1.0, 1.0078125, 256.0, -1.0, 3e38, 1e-39, 0.0, -0.0, float("nan")])
    # Half an ulp of bf16 at each value (exactly representable in bf16 here: powers of two).
    half = torch.tensor([2**-8, 2**-8, 1.0, -(2**-8), 3e38, 1e-41, -0.0, -0.0, 1.0])
    x = lo.to(torch.bfloat16).repeat(64)[:576].reshape(1, 576)
    res = half.to(torch.bfloat16).repeat(64)[:576].reshape(1, 576)
    w = torch.ones(576, dtype=torch.bfloat16)
    _, s = ops.add_rms_norm(x, res, w, 1e-5)
    ref = x + res
    nan = ref.isnan()  # (torch's own NaN bits differ between its scalar and vector paths)
    assert torch.equal(s.isnan(), nan) and nan.any()
    assert torch.equal(s.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "head_size,rotary_dim,neox,heads_q,heads_k",
    [(64, 64, True, 9, 3), (32, 16, True, 4, 4), (48, 48, False, 8, 1), (24, 8, False, 2, 2)],
)
def test_rotary_matches_torch_exactly(dtype, head_size, rotary_dim, neox, heads_q, heads_k):
    rope = RotaryEmbedding(head_size, rotary_dim, 512, 10000.0, is_neox_style=neox)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 511, 17, 17])
    T = len(positions)
    q = torch.randn(T, heads_q * head_size, generator=g).to(dtype)
    k = torch.randn(T, heads_k * head_size, generator=g).to(dtype)
    cos, sin = rope._cos[positions].unsqueeze(1), rope._sin[positions].unsqueeze(1)
    ref_q = rope._rotate(q.view(T, -1, head_size), cos, sin).reshape(q.shape)
    ref_k = rope._rotate(k.view(T, -1, head_size), cos, sin).reshape(k.shape)
    oq, ok = ops.rotary_embedding(
        positions, q, k, rope._cos, rope._sin, head_size, rotary_dim, neox
    )
    assert torch.equal(oq, ref_q) and torch.equal(ok, ref_k)
    rope._rotate = _no_torch_path
    mq, mk = rope(positions, q, k)  # the module's fused path
    assert torch.equal(mq, ref_q) and torch.equal(mk, ref_k)


def test_rotary_rejects_a_position_outside_the_cache():
    rope = RotaryEmbedding(16, 16, 8, 10000.0)
    q = torch.randn(1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_embedding(torch.tensor([8]), q, q, rope._cos, rope._sin, 16, 16, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_as_mla_slices_them(dtype, monkeypatch):
    """DeepSeek's MLA hands over column slices: q_pe = q[..., nope:], k_pe and kv_c = columns of
    one projection. The ops read them in place and return what the torch path returns."""
    g = torch.Generator().manual_seed(2)
    T, H, nope, rope_dim, rank = 5, 4, 16, 8, 32
    q = torch.randn(T, H, nope + rope_dim, generator=g).to(dtype)
    kv = torch.randn(T, rank + rope_dim, generator=g).to(dtype)
    q_pe, (kv_c, k_pe) = q[..., nope:], kv.split([rank, rope_dim], dim=-1)
    rope = RotaryEmbedding(rope_dim, rope_dim, 64, 10000.0, is_neox_style=False)
    positions = torch.tensor([3, 1, 4, 1, 5])
    cos, sin = rope._cos[positions].unsqueeze(1), rope._sin[positions].unsqueeze(1)
    ref_q = rope._rotate(q_pe.reshape(T, -1, rope_dim), cos, sin)
    ref_k = rope._rotate(k_pe.reshape(T, -1, rope_dim), cos, sin).reshape(T, rope_dim)
    monkeypatch.setattr(rope, "_rotate", _no_torch_path)  # the fused op must take them
    oq, ok = rope(positions, q_pe, k_pe)
    assert torch.equal(oq, ref_q) and torch.equal(ok, ref_k)
    m = RMSNorm(rank).to(dtype)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    ref = m._norm(kv_c.contiguous())
    monkeypatch.setattr(m, "_norm", _no_torch_path)
    torch.testing.assert_close(m(kv_c), ref, **tol)


def _no_torch_path(*args):
    raise AssertionError("the torch path ran where the fused CPU op should have")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3072), (5, 64), (2, 3, 32)])
def test_silu_and_mul_is_the_torch_result(dtype, shape, monkeypatch):
    from vllm.model_executor.layers.activation import SiluAndMul

    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    d = shape[-1] // 2
    ref = torch.nn.functional.silu(x[..., :d]) * x[..., d:]
    assert torch.equal(ops.silu_and_mul(x), ref)
    # The module takes the op (a spy sees the call) and returns the same.
    calls = []
    monkeypatch.setattr(ops, "silu_and_mul", lambda t: calls.append(t) or ref)
    assert torch.equal(SiluAndMul()(x), ref) and len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_copies_each_token_to_its_slot(dtype):
    from vllm.attention.backends.torch_paged import write_kv

    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(4, 9 * 64 + 6 * 64, generator=g).to(dtype)
    # k / v as the attention layer has them: row-strided views of the qkv projection.
    k, v = qkv[:, 576:768].view(4, 3, 64), qkv[:, 768:].view(4, 3, 64)
    slots = torch.tensor([5, 17, -1, 39])
    cache = torch.randn(2, 40, 3, 64, generator=g).to(dtype)
    ref = cache.clone()
    keep = slots >= 0
    ref[0][slots[keep]], ref[1][slots[keep]] = k[keep], v[keep]
    ops.write_kv(cache, slots, k, v)
    assert torch.equal(cache, ref)  # slot -1 (padding) untouched, every other row exact
    with pytest.raises(RuntimeError, match="slot 40 is outside the cache's 40 slots"):
        ops.write_kv(cache, torch.tensor([40]), k[:1], v[:1])
    # The backend's writer: the op for this layout, torch's writes for a cache of another
    # dtype (converted), the same contents either way.
    for cdt in (dtype, torch.float32 if dtype == torch.bfloat16 else torch.bfloat16):
        c = torch.zeros(2, 40, 3, 64, dtype=cdt)
        write_kv(c, slots[:2], k[:2], v[:2])
        assert torch.equal(c[0][slots[:2]], k[:2].to(cdt))
        assert torch.equal(c[1][slots[:2]], v[:2].to(cdt))
