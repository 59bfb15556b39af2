# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The C++ CPU kernels under csrc/cpu, built just in time with torch.utils.cpp_extension.

Built on first use into a cache folder keyed by the sources, the flags, torch and the CPU, so
later starts only load the library. No compiler, no sources (an installed wheel has no csrc/),
or VLLM_CPU_KERNELS=0: callers get False from cpu_kernels_available() and use their torch
reference path; the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import time
from pathlib import Path

import torch

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
# The compiled unit; it includes the kernel files (a unity build: torch's headers parsed once).
SOURCES = ("torch_bindings.cpp",)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build_dir() -> Path:
    root = envs.VLLM_CPU_KERNELS_BUILD_DIR
    if root:
        return Path(root)
    return envs.cache_root() / "cpu_kernels"


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (first time) or load the CPU kernels; False means: use the torch path."""
    if not envs.VLLM_CPU_KERNELS:
        logger.info("VLLM_CPU_KERNELS=0: CPU attention runs the torch reference path")
        return False
    paths = [CSRC / s for s in SOURCES]
    if not all(p.is_file() for p in paths):
        logger.warning(
            "CPU kernel sources not found under %s; using the torch reference path", CSRC
        )
        return False
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*.[ch]*")):  # every file the unit includes
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_id().encode())
    name = f"vllm_cpu_ops_{h.hexdigest()[:16]}"
    out = build_dir() / name
    t0 = time.perf_counter()
    built = out / f"{name}.so"
    if built.is_file():
        # The name hashes every input of the build, so an existing library is current: load it
        # without asking ninja (a second start pays ~50 ms, not ~0.4 s).
        try:
            torch.ops.load_library(str(built))
            _register_fakes()
            return True
        except OSError as e:
            logger.debug("rebuilding %s: %s", built, e)
    try:
        from torch.utils import cpp_extension

        out.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in paths],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means: reference path
        logger.warning(
            "could not build the CPU kernels (%s: %s); using the torch reference path "
            "(set VLLM_CPU_KERNELS=0 to skip the attempt)",
            type(e).__name__,
            " ".join(str(e).split())[-600:],  # the compiler's error is at the end
        )
        return False
    logger.debug("CPU kernels %s loaded in %.2f s", name, time.perf_counter() - t0)
    _register_fakes()
    return True


_fakes_registered = False


def _register_fakes() -> None:
    """Shape functions, so that torch.compile can trace through the ops."""
    global _fakes_registered
    lib = "vllm_cpu::"
    if _fakes_registered:
        return
    _fakes_registered = True
    torch.library.register_fake(lib + "paged_attention")(lambda out, *args: None)
    torch.library.register_fake(lib + "rms_norm")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake(lib + "add_rms_norm")(
        lambda x, r, w, eps: (torch.empty_like(x), torch.empty_like(x))
    )
    torch.library.register_fake(lib + "rotary_embedding")(
        lambda pos, q, k, *args: (torch.empty_like(q), torch.empty_like(k))
    )
    torch.library.register_fake(lib + "prefill_attention")(lambda out, *args: None)
    torch.library.register_fake(lib + "linear_small_m")(
        lambda x, w, b, isa=0: x.new_empty(x.shape[0], w.shape[0])
    )
    torch.library.register_fake(lib + "write_kv")(lambda cache, slots, k, v: None)
    torch.library.register_fake(lib + "silu_and_mul")(
        lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    )


_available: bool | None = None  # cpu_kernels_available(), once known (cheap for torch.compile)


def cpu_op_ok(x: torch.Tensor) -> bool:
    """Whether a CPU op may take x: a CPU float tensor whose last dimension is contiguous (the
    callers check the rest of the layout), kernels built."""
    global _available
    # is_cpu, not device.type: a per-op check on the decode path (device builds an object).
    if not x.is_cpu or x.dtype not in _FLOAT_DTYPES or x.stride(-1) != 1:
        return False
    if _available is None:
        _available = cpu_kernels_available()
    return _available


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension (the RMSNorm module's arithmetic)."""
    return torch.ops.vllm_cpu.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), without writing to either input."""
    return torch.ops.vllm_cpu.add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k ([T, heads * head_size] or [T, heads, head_size]) at
    positions, from fp32 cos/sin caches [max_position, rotary_dim // 2]."""
    return torch.ops.vllm_cpu.rotary_embedding(
        positions, q, k, cos, sin, head_size, rotary_dim, is_neox
    )


# The small-M linear's instruction-set paths (csrc/cpu/linear.cpp), by VLLM_CPU_LINEAR_ISA name.
LINEAR_ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}


@functools.cache
def linear_isa() -> int:
    """The path linear_small_m runs (VLLM_CPU_LINEAR_ISA, resolved against the CPU once;
    cache_clear() after changing the variable). ValueError naming the variable when the CPU
    lacks the one asked for."""
    probe = torch.ops.vllm_cpu.linear_small_m_isa
    return _resolve_isa("VLLM_CPU_LINEAR_ISA", envs.VLLM_CPU_LINEAR_ISA, probe)


def linear_isas_available() -> list[str]:
    """The VLLM_CPU_LINEAR_ISA paths (other than auto) this CPU can run."""
    return _isas_available(torch.ops.vllm_cpu.linear_small_m_isa)


def _resolve_isa(var: str, name: str, probe) -> int:
    """The path code of ISA name `name` (the value of environment variable `var`) that probe,
    a kernel's *_isa op, accepts on this CPU; ValueError naming the variable otherwise."""
    try:
        return int(probe(LINEAR_ISAS[name]))
    except RuntimeError as e:
        raise ValueError(f"{var}={name}: this CPU cannot run that path") from e


def _isas_available(probe) -> list[str]:
    ok = []
    for name, code in LINEAR_ISAS.items():
        if code == 0:
            continue
        try:
            probe(code)
        except RuntimeError:
            continue
        ok.append(name)
    return ok


@functools.cache
def prefill_attention_isa() -> int:
    """The path prefill_attention runs (VLLM_CPU_PREFILL_ATTN_ISA, same names as
    VLLM_CPU_LINEAR_ISA, resolved against the CPU once; cache_clear() after changing the
    variable). ValueError naming the variable when the CPU lacks the one asked for."""
    probe = torch.ops.vllm_cpu.prefill_attention_isa
    return _resolve_isa("VLLM_CPU_PREFILL_ATTN_ISA", envs.VLLM_CPU_PREFILL_ATTN_ISA, probe)


def prefill_attention_isas_available() -> list[str]:
    """The VLLM_CPU_PREFILL_ATTN_ISA paths (other than auto) this CPU can run."""
    return _isas_available(torch.ops.vllm_cpu.prefill_attention_isa)


def linear_small_m(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) for the rows of a decode / verify / draft step, fp32
    or bf16, accumulated in fp32: each block of weight rows is streamed from memory once for all
    M rows. A row's result does not depend on M or on the other rows (batch-invariant)."""
    return torch.ops.vllm_cpu.linear_small_m(x, weight, bias, linear_isa())


def write_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """kv_cache[0][slot_mapping] = k; kv_cache[1][slot_mapping] = v in one call (kv_cache
    [2, slots, kv_heads, head_size] contiguous; k, v [tokens, kv_heads, head_size] in its
    dtype, each token's values contiguous; a negative slot is padding, not written)."""
    torch.ops.vllm_cpu.write_kv(kv_cache, slot_mapping, k, v)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] (ATen's own kernels: the torch path's result)."""
    return torch.ops.vllm_cpu.silu_and_mul(x)


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    scale: float,
    blocks_per_split: int = 0,
    tree_mask: torch.Tensor | None = None,
) -> None:
    """out[t] = causal attention of q[t] over its request's paged keys/values, for the tokens
    of the requests in `rows` (other rows of out are left alone).

    q [T, H, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, Dv] (strided views allowed,
    head dim contiguous), out [T, H, Dv]; block_table [R, max_blocks], seq_lens [R],
    query_start_loc [R + 1], rows [n]: int64. The query of request r is the last
    q_len = qsl[r+1] - qsl[r] positions of its seq_lens[r] tokens. blocks_per_split <= 0 picks
    the key split that keeps every thread busy. tree_mask (draft trees): a contiguous bool /
    int8 [R, M, M], M >= every q_len in rows; query token i of request r then sees the step's
    token j (position ctx + j, ctx = seq_lens[r] - q_len) iff tree_mask[r, i, j], instead of
    iff j <= i; the cached context stays visible. Rows must be in topological order (the mask
    lower-triangular). A row that sees nothing gets zeros."""
    torch.ops.vllm_cpu.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        rows,
        block_size,
        scale,
        blocks_per_split,
        tree_mask,
    )


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int = 0,
) -> None:
    """paged_attention's result for prefill / chunked-prefill requests (long queries), read
    straight from the paged cache in query x key tiles with an online softmax (no padding, no
    mask tensor): out[t] for the tokens of the requests in `rows`, other rows left alone.
    Same layouts as paged_attention; sliding_window > 0: a query at position p sees the keys
    at positions (p - sliding_window, p]."""
    torch.ops.vllm_cpu.prefill_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        rows,
        block_size,
        scale,
        sliding_window,
        prefill_attention_isa(),
    )
