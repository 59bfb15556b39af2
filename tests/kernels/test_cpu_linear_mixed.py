# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""fp32 rows by bf16 weights: the small-M kernel's product equals, bit for bit, the product with
the weights widened to fp32 (every instruction-set path this CPU runs), linear() routes such
weights like any other (prefill rows through BLAS on the widened weights), and
keep_exact_bf16_weights narrows exactly the weights that lose nothing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm import _custom_ops as ops
from vllm.forward_context import ALL_SHORT, ForwardContext
from vllm.model_executor.layers import gemm
from vllm.model_executor.layers.exact_bf16 import keep_exact_bf16_weights
from vllm.model_executor.layers.linear import ReplicatedLinear, RoutedLinear

from .test_cpu_linear import _meta, isa  # noqa: F401  (the per-path fixture)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        pytest.skip("VLLM_CPU_KERNELS=0: the torch reference path is forced")
    assert ops.cpu_kernels_available(), "the CPU kernels did not build (see the log)"


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_rows_by_bf16_weights_equal_the_widened_product(isa, bias):  # noqa: F811
    """M = 1..33 (one-row tile, 4-row tiles, one, two and three tiles sharing a weight block:
    widened in registers or per block), N and K off every tile and vector width."""
    shapes = [(13, 37), (64, 576), (4, 8), (7, 33), (47, 129), (1, 71)]
    for n, k in shapes:
        for m in range(1, 34):
            g = torch.Generator().manual_seed(m * 1000 + n + k)
            x = torch.randn(m, k, generator=g)
            w = torch.randn(n, k, generator=g).to(torch.bfloat16)
            b = torch.randn(n, generator=g) if bias else None
            got = ops.linear_small_m(x, w, b)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert torch.equal(got, ops.linear_small_m(x, w.float(), b)), (n, k, m)


def test_bf16_rows_by_fp32_weights_are_refused():
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear_small_m(x, torch.randn(4, 8), None)


def test_linear_routes_bf16_weights_under_fp32_rows():
    """Decode rows: the kernel on the bf16 weight (equal to the fp32 weight's kernel product);
    prefill rows: BLAS on the widened weight; a step with both: each its own way."""
    g = torch.Generator().manual_seed(3)
    w32 = torch.randn(24, 40, generator=g).to(torch.bfloat16).float()
    w16 = w32.to(torch.bfloat16)
    for q_lens, short_len in [([1] * 7, 1), ([4, 4], 4), ([9], 4), ([6, 1, 1], 4)]:
        x = torch.randn(sum(q_lens), 40, generator=g)
        rows = ForwardContext(_meta(q_lens, short_len)).rows
        got = gemm.linear(x, w16, None, rows)
        assert got.dtype == torch.float32
        assert torch.equal(got, gemm.linear(x, w32, None, rows)), q_lens
    x = torch.randn(5, 40, generator=g)
    assert torch.equal(gemm.linear(x, w16, None, None), F.linear(x, w32))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.exact = RoutedLinear(16, 8, bias=True)
        self.packed = ReplicatedLinear(16, 8, bias=False)
        self.inexact = RoutedLinear(16, 8, bias=False)
        self.norm = nn.Parameter(torch.randn(16, generator=g).to(torch.bfloat16).float())
        with torch.no_grad():
            self.exact.weight.copy_(torch.randn(8, 16, generator=g).to(torch.bfloat16).float())
            self.exact.bias.copy_(torch.randn(8, generator=g))
            self.packed.weight.copy_(torch.randn(8, 16, generator=g).to(torch.bfloat16).float())
            self.inexact.weight.copy_(torch.randn(8, 16, generator=g))  # fp32 values


def test_keep_exact_bf16_weights_narrows_only_what_loses_nothing():
    head = _Head()
    x = torch.randn(3, 16)
    before = {n: getattr(head, n)(x, ALL_SHORT) for n in ("exact", "packed", "inexact")}
    saved = keep_exact_bf16_weights(head)
    assert saved == 2 * 8 * 16 * 2  # two 8 x 16 weights, 2 bytes each
    assert head.exact.weight.dtype == head.packed.weight.dtype == torch.bfloat16
    assert head.inexact.weight.dtype == torch.float32  # would round
    assert head.exact.bias.dtype == head.norm.dtype == torch.float32  # not a linear weight
    for name, y in before.items():
        assert torch.equal(getattr(head, name)(x, ALL_SHORT), y), name
