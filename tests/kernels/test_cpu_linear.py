# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The CPU small-M linear kernel (decode-step GEMM) against an fp64 torch product, and the
linear() dispatch that the linear layers and the LM head use."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from vllm import _custom_ops as ops
from vllm.model_executor.layers import linear as linear_mod


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        pytest.skip("VLLM_CPU_KERNELS=0: the torch reference path is forced")
    assert ops.cpu_kernels_available(), "the CPU kernels did not build (see the log)"


def _ref(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 16, 33])
@pytest.mark.parametrize("n,k", [(13, 37), (64, 576), (4, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_small_m_matches_reference(dtype, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = ops.linear_small_m(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    ref = _ref(x, w, b)
    # fp32 accumulation of k products; bf16 output rounded once (8 significant bits).
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 8e-3}
    torch.testing.assert_close(got.double(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_small_m_strided_operands(dtype):
    """Rows of a wider matrix (a packed projection's shard, a sliced activation)."""
    g = torch.Generator().manual_seed(1)
    big_w = torch.randn(20, 50, generator=g).to(dtype)
    w = big_w[3:14, 5:45]  # row stride 50, 40 columns
    big_x = torch.randn(6, 70, generator=g).to(dtype)
    x = big_x[:, 10:50]
    assert w.stride(0) != w.shape[1] and x.stride(0) != x.shape[1]
    got = ops.linear_small_m(x, w, None)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 8e-3}
    torch.testing.assert_close(got.double(), _ref(x, w, None), **tol)


def test_linear_small_m_rejects_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        ops.linear_small_m(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear_small_m(x, torch.randn(4, 8, dtype=torch.bfloat16), None)


def test_linear_dispatch(monkeypatch):
    """bf16 decode-sized products take the kernel; prefill-sized ones and fp32 take BLAS; all
    give F.linear's result, and a bf16 row's result does not depend on the rows next to it."""
    calls = []
    real = linear_mod.linear_small_m
    monkeypatch.setattr(
        linear_mod, "linear_small_m", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    w = torch.randn(24, 40)
    for m, dtype, kernel in [
        (1, torch.float32, False),
        (4, torch.float32, False),
        (1, torch.bfloat16, False),
        (2, torch.bfloat16, True),
        (16, torch.bfloat16, True),
        (linear_mod.SMALL_M_MAX_ROWS + 1, torch.bfloat16, False),  # prefill: BLAS (fp32)
    ]:
        calls.clear()
        x = torch.randn(m, 40).to(dtype)
        y = linear_mod.linear(x, w.to(dtype))
        assert (calls == [m]) is kernel
        tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.to(dtype).float()), **tol)


def test_kernel_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(linear_mod.SMALL_M_MAX_ROWS, 96, generator=g).to(torch.bfloat16)
    alone = ops.linear_small_m(x[3:4], w, None)
    for m in (4, 5, linear_mod.SMALL_M_MAX_ROWS):
        assert torch.equal(ops.linear_small_m(x[:m], w, None)[3:4], alone)


def test_bf16_prefill_product_is_the_fp32_product_rounded_once():
    """Past the kernel's rows, a bf16 product on a CPU without a native bf16 GEMM is BLAS on
    fp32 copies rounded once: the same arithmetic as torch's bf16 linear, 5-7x faster."""
    if linear_mod._cpu_has_bf16_gemm():
        pytest.skip("this CPU has a native bf16 GEMM (torch's bf16 linear is used)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(linear_mod.SMALL_M_MAX_ROWS + 7, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    expected = F.linear(x.float(), w.float(), b.float()).bfloat16()
    assert torch.equal(linear_mod.linear(x, w, b), expected)
    torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b), atol=0.1, rtol=1e-2)
