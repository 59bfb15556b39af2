# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The CPU small-M linear kernel (decode-step GEMM) against an fp64 torch product, and the
linear() dispatch that the linear layers and the LM head use."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm import _custom_ops as ops
from vllm.forward_context import ALL_SHORT, ForwardContext
from vllm.model_executor.layers import gemm as linear_mod


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0":
        pytest.skip("VLLM_CPU_KERNELS=0: the torch reference path is forced")
    assert ops.cpu_kernels_available(), "the CPU kernels did not build (see the log)"


def _ref(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _tol(dtype):
    # fp32 accumulation of k products; bf16 output rounded once (8 significant bits).
    return {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 8e-3}


@pytest.fixture(params=["portable", "avx2", "avx512", "avx512bf16"])
def isa(request, monkeypatch):
    """Each instruction-set path of the kernel this CPU can run, forced by VLLM_CPU_LINEAR_ISA."""
    if request.param not in ops.linear_isas_available():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    monkeypatch.setenv("VLLM_CPU_LINEAR_ISA", request.param)
    ops.linear_isa.cache_clear()
    assert ops.linear_isa() == ops.LINEAR_ISAS[request.param]
    yield request.param
    ops.linear_isa.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_small_m_matches_reference(isa, dtype, bias):
    """M = 1..33 (the one-row tile, the 4-row tiles and their remainders, several passes over
    a weight block), N off every tile width (blocks of 3, 6 and 8 weight rows and their
    leftover rows) and K off the vector widths (masked K tails: 8, 16 and 32 lanes; K shorter
    than one vector), against an fp64 product."""
    shapes = [(13, 37), (64, 576), (4, 8), (7, 33), (9, 100), (23, 5), (1, 71), (47, 129)]
    for n, k in shapes:
        for m in range(1, 34):
            g = torch.Generator().manual_seed(m * 1000 + n + k)
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            got = ops.linear_small_m(x, w, b)
            assert got.dtype == dtype and got.shape == (m, n)
            torch.testing.assert_close(got.double(), _ref(x, w, b), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_small_m_strided_operands(isa, dtype):
    """Rows of a wider matrix (a packed projection's shard, a sliced activation)."""
    g = torch.Generator().manual_seed(1)
    big_w = torch.randn(20, 50, generator=g).to(dtype)
    w = big_w[3:14, 5:45]  # row stride 50, 40 columns
    big_x = torch.randn(6, 70, generator=g).to(dtype)
    x = big_x[:, 10:50]
    assert w.stride(0) != w.shape[1] and x.stride(0) != x.shape[1]
    got = ops.linear_small_m(x, w, None)
    torch.testing.assert_close(got.double(), _ref(x, w, None), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_alone_equals_the_row_among_2_to_32_rows(isa, dtype):
    """Bit for bit, a row computed alone (the one-row tile) equals the same row at the first,
    a middle and the last position of every batch of 2..32 rows (4-row tiles and their
    remainders; bf16 weights widened per block once several tiles share it), with odd N and
    K (leftover weight rows, masked K tail) and a bias."""
    g = torch.Generator().manual_seed(7)
    n, k = 103, 301
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    row = torch.randn(1, k, generator=g).to(dtype)
    alone = ops.linear_small_m(row, w, b)
    for m in range(2, 33):
        for at in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g).to(dtype)
            x[at] = row[0]
            got = ops.linear_small_m(x, w, b)
            assert torch.equal(got[at : at + 1], alone), (m, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_row_is_bit_identical_whatever_shares_the_call(isa, dtype):
    """A row's output does not depend on M or on its neighbours: alone (M = 1) and at every
    position among 15 other rows, bit for bit; with the output columns split across threads
    too (a weight large enough to be split)."""
    g = torch.Generator().manual_seed(2)
    for n, k in [(40, 96), (2051, 577), (4100, 768)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        x = torch.randn(16, k, generator=g).to(dtype)
        batch = ops.linear_small_m(x, w, b)
        for r in range(16):
            alone = ops.linear_small_m(x[r : r + 1], w, b)
            assert torch.equal(batch[r : r + 1], alone), (n, k, r)
        for m in (2, 3, 5, 17):
            others = torch.randn(m, k, generator=g).to(dtype)
            mixed = torch.cat([others[: m // 2], x[7:8], others[m // 2 :]])
            got = ops.linear_small_m(mixed, w, b)[m // 2]
            assert torch.equal(got, batch[7]), (n, k, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_row_gives_the_same_bits_in_a_tile_and_alone(isa, dtype):
    """Output column j is the same bits whether its weight row sits in a full register tile
    (whose horizontal sums the AVX512 paths take 16 at a time, transposed) or among the last
    N % NR rows, which run one at a time (one horizontal sum each): the tile's sums must pair
    the lanes exactly as the single sum does. N = 13 leaves 5 rows alone at M = 1 (tiles of 8
    weight rows) and 1 at M > 1 (tiles of 6 on AVX512, 3 on AVX2)."""
    g = torch.Generator().manual_seed(5)
    n, k = 13, 577
    w = torch.randn(n, k, generator=g).to(dtype)
    for m in (1, 2, 4, 7):
        x = torch.randn(m, k, generator=g).to(dtype)
        full = ops.linear_small_m(x, w, None)
        for j in range(n):
            order = [i for i in range(n) if i != j] + [j]  # row j last: computed alone
            last = ops.linear_small_m(x, w[order].contiguous(), None)
            assert torch.equal(last[:, -1], full[:, j]), (m, j)
            assert torch.equal(last[:, :-1], full[:, order[:-1]]), (m, j)


def test_paths_agree_with_each_other_to_rounding():
    """Every path this CPU runs computes the same product (they differ only in rounding)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=g)
    w = torch.randn(70, 300, generator=g)
    outs = {
        name: torch.ops.vllm_cpu.linear_small_m(x, w, None, ops.LINEAR_ISAS[name])
        for name in ops.linear_isas_available()
    }
    for name, y in outs.items():
        torch.testing.assert_close(y, outs["portable"], atol=1e-4, rtol=1e-5, msg=name)


def test_bad_isa_variable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_LINEAR_ISA", "sse9")
    ops.linear_isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="VLLM_CPU_LINEAR_ISA"):
            ops.linear_isa()
    finally:
        ops.linear_isa.cache_clear()
    with pytest.raises(RuntimeError, match="instruction-set path"):
        torch.ops.vllm_cpu.linear_small_m_isa(9)


def test_linear_small_m_rejects_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        ops.linear_small_m(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear_small_m(x.to(torch.bfloat16), torch.randn(4, 8), None)


def _count_kernel_rows(monkeypatch):
    calls: list[int] = []
    real = linear_mod.linear_small_m
    monkeypatch.setattr(
        linear_mod, "linear_small_m", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    return calls


def _meta(q_lens, short_query_len):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return SimpleNamespace(
        query_start_loc_np=qsl, short_query_len=short_query_len, device=torch.device("cpu")
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_routes_rows_by_kind(monkeypatch, dtype):
    """Decode / verify / draft rows take the kernel whatever their number; prefill rows take
    BLAS whatever their number; no forward (no row kinds): BLAS."""
    calls = _count_kernel_rows(monkeypatch)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=g).to(dtype)
    tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}
    for q_lens, short_len, kernel_rows in [
        ([1] * 40, 1, [40]),  # 40 decode rows: the kernel (no threshold on M)
        ([4, 4, 4], 4, [12]),  # verify rows (K = 3)
        ([2], 1, []),  # a 2-token prefill chunk: BLAS
        ([5, 1, 1], 4, [2]),  # mixed: the decode rows only
    ]:
        calls.clear()
        x = torch.randn(sum(q_lens), 40, generator=g).to(dtype)
        y = linear_mod.linear(x, w, None, ForwardContext(_meta(q_lens, short_len)).rows)
        assert calls == kernel_rows, (q_lens, calls)
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), **tol)
    calls.clear()
    linear_mod.linear(torch.randn(3, 40).to(dtype), w, None, None)
    assert calls == []
    linear_mod.linear(torch.randn(3, 40).to(dtype), w, None, ALL_SHORT)
    assert calls == [3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_row_is_bit_identical_whatever_the_step_holds(dtype):
    """A decode row's linear output is the same bits alone, among other decode rows, and next
    to a prefill chunk (the mixed step splits the rows by kind)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(300, 128, generator=g).to(dtype)
    b = torch.randn(300, generator=g).to(dtype)
    row = torch.randn(1, 128, generator=g).to(dtype)
    alone = linear_mod.linear(row, w, b, ForwardContext(_meta([1], 1)).rows)
    for q_lens, at in [([1] * 9, 4), ([7, 1, 1], 8), ([1, 30], 0), ([4, 4, 1], 8)]:
        x = torch.randn(sum(q_lens), 128, generator=g).to(dtype)
        x[at] = row[0]
        ctx = ForwardContext(_meta(q_lens, 4 if 4 in q_lens else 1))
        y = linear_mod.linear(x, w, b, ctx.rows)
        assert torch.equal(y[at : at + 1], alone), q_lens
    pad = torch.cat(
        [torch.randn(5, 128, generator=g).to(dtype), row, torch.zeros(2, 128).to(dtype)]
    )
    # Two padding rows past the batch.
    y = linear_mod.linear(pad, w, b, ForwardContext(_meta([5, 1], 1)).rows)
    assert torch.equal(y[5:6], alone)
    torch.testing.assert_close(
        y[:5].float(),
        F.linear(pad[:5].float(), w.float(), b.float()),
        **({} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1e-2}),
    )


@pytest.fixture
def clear_gemm_route(monkeypatch):
    monkeypatch.setattr(linear_mod, "_chosen", {})
    yield
    linear_mod._chosen.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gemm_routes_match_the_fp64_product(dtype, monkeypatch, clear_gemm_route):
    """Every BLAS route a prefill product may take (VLLM_CPU_PREFILL_GEMM forces one) against
    an fp64 product; bf16 through fp32 is the fp32 product rounded once (the same arithmetic
    as torch's bf16 linear, 5-7x faster without a native bf16 GEMM). auto picks a candidate."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g).to(dtype)
    w = torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    ref = _ref(x, w, b)
    for route in linear_mod.prefill_gemm_candidates(dtype):
        monkeypatch.setenv("VLLM_CPU_PREFILL_GEMM", route)
        linear_mod._chosen.clear()
        y = linear_mod.linear(x, w, b, None)  # outside a forward: prefill-kind rows
        assert linear_mod.prefill_gemm_route(dtype) == route
        torch.testing.assert_close(y.double(), ref, **_tol(dtype))
        if route == "fp32":
            assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).bfloat16())
    monkeypatch.setenv("VLLM_CPU_PREFILL_GEMM", "auto")
    linear_mod._chosen.clear()
    torch.testing.assert_close(linear_mod.linear(x, w, b, None).double(), ref, **_tol(dtype))
    assert linear_mod.prefill_gemm_route(dtype) in linear_mod.prefill_gemm_candidates(dtype)


def test_prefill_gemm_route_not_for_the_dtype_is_a_value_error(monkeypatch, clear_gemm_route):
    monkeypatch.setenv("VLLM_CPU_PREFILL_GEMM", "fp32")
    with pytest.raises(ValueError, match="VLLM_CPU_PREFILL_GEMM"):
        linear_mod.linear(torch.randn(4, 8), torch.randn(3, 8), None, None)


@pytest.mark.slow
def test_avx512_paths_compile_with_explicit_isa_flags(tmp_path):
    """The AVX512F and AVX512-BF16 paths, which an AVX2-only CPU cannot run, compile to
    machine code with the instruction sets switched on by -m flags (not only through the
    target attributes of the normal build): linear.cpp alone to an object file, whose
    micro-kernels hold 512-bit FMAs and vdpbf16ps. And the register tiles' loops load each
    weight and x vector once per step: under -O3 with Zen tuning (what -march=native picks on
    the project's EPYC machines) GCC folded the weight loads into every FMA that reads them
    (24 loads per 24 FMAs in the 4 x 6 tile, load-bound), so no FMA of a tile may take a
    memory operand other than the stack (the AVX2 tail step's zero-padded copy)."""
    import shutil
    import subprocess

    from torch.utils.cpp_extension import include_paths

    cxx, objdump = shutil.which("g++"), shutil.which("objdump")
    if cxx is None or objdump is None:
        pytest.skip("needs g++ and objdump")
    obj = tmp_path / "linear_avx512.o"
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma"]
    cmd = [cxx, "-std=c++17", "-O3", "-mtune=znver3", "-fopenmp", "-c", *flags]
    cmd += [f"-I{p}" for p in include_paths()]
    cmd += [str(ops.CSRC / "linear.cpp"), "-o", str(obj)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    asm = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(obj)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    tiles = (
        "micro_avx512bf16<4, 6>",
        "micro_avx512<4, 6, float, float>",
        "micro_avx512<4, 6, float, c10::BFloat16>",
        "micro_avx2<4, 3, float, float>",
    )
    bodies: dict[str, str] = {}
    for chunk in asm.split("\n\n"):
        head = chunk.strip().split("\n", 1)[0]
        for name in tiles:
            if name in head and head.endswith(">:"):
                bodies[name] = chunk
    assert set(bodies) == set(tiles)
    assert "vdpbf16ps" in bodies["micro_avx512bf16<4, 6>"]
    assert re.search(r"vfmadd\d+ps\s+%zmm", bodies["micro_avx512<4, 6, float, float>"])
    for name, body in bodies.items():
        products = re.findall(r"(?:vfmadd\d+ps|vdpbf16ps)\s+(\S+)", body)
        assert len(products) >= 12, name
        folded = [op for op in products if "(" in op and "%rsp" not in op]
        assert not folded, f"{name}: {len(folded)} of {len(products)} FMAs load an operand"
