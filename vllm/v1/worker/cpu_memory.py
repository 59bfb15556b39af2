# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Process-wide memory settings of a CPU worker, so that its resident memory after start-up
(pools touched, step memory reserved, warm-up run) is what it keeps under load.

Two things grew a CPU stage's memory for thousands of requests after start-up:
- oneDNN's primitive cache and PyTorch's ideep cache keep one entry (~0.5 MiB) per GEMM shape,
  up to 1024 each, and every new batch size is a new shape: both are bounded here.
- glibc's malloc starts by mmapping large blocks and raises that threshold (up to 32 MiB) the
  first time one is freed, after which activations of that size come from the heap, which then
  grows past what start-up used. The thresholds are fixed at the values it converges to, so
  the heap that start-up grows (below) is the one steps use. Returning large blocks to the
  system on every free instead costs a page fault per 4 KiB touched on every step (~30x the
  time of reusing heap memory for a 3 MiB activation, measured).

Once the pools are allocated, the heap is grown by what a full step's activations take
(reserve_heap, sized by the runner from the model's widths and max_num_batched_tokens): those
pages are written once and kept (automatic trimming stays above them), so the steps reuse them
and a stage's resident memory after start-up is what it keeps under load, without replaying a
full token budget at start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

# glibc's mallopt parameters and its largest mmap threshold on 64-bit (4 MiB * sizeof(long)).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
# Larger allocations are mapped (and returned on free), never taken from the heap.
HEAP_ALLOCATION_MAX = _MMAP_THRESHOLD_MAX

_configured = False


def configure_cpu_process_memory() -> None:
    """Call before this process runs its first oneDNN GEMM (the libraries read their cache
    sizes then); settings the user made are kept. Idempotent."""
    global _configured
    if _configured:
        return
    _configured = True
    envs.bound_onednn_caches()
    _fix_malloc_thresholds()


def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None


_RESERVE_CHUNK = 8 * 2**20  # under the mmap threshold: served from the heap


def reserve_heap(nbytes: int) -> int:
    """Grow this thread's malloc heap by about nbytes of written pages and keep them: chunks
    under the mmap threshold are allocated, written and freed, with the trim threshold raised
    above them so that free() does not hand them back. Call from the thread that runs the
    steps (its arena serves their activations). Returns the bytes reserved (0: no mallopt)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    if libc is None or nbytes <= 0:
        return 0
    trim = min(int(nbytes) + 2 * _MMAP_THRESHOLD_MAX, 2**31 - 1)
    if not libc.mallopt(_M_TRIM_THRESHOLD, trim):
        return 0
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    chunks = []
    for _ in range(-(-int(nbytes) // _RESERVE_CHUNK)):
        p = libc.malloc(_RESERVE_CHUNK)
        if not p:
            break
        libc.memset(p, 0, _RESERVE_CHUNK)
        chunks.append(p)
    for p in chunks:
        libc.free(p)
    return len(chunks) * _RESERVE_CHUNK


def _fix_malloc_thresholds() -> None:
    mallopt = _mallopt()
    if mallopt is None:
        logger.debug("no mallopt in this C library; malloc thresholds left as they are")
        return
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(
        _M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX
    )
    if not ok:
        logger.debug("mallopt refused the malloc thresholds; left as they are")


def reserve_step_activations(vllm_config: Any, modules: list[Any], stage: int) -> int:
    """Grow the heap by what a full step's activations take, and load the CPU kernels' library
    here rather than in the first request; returns the bytes reserved."""
    from vllm._custom_ops import cpu_kernels_available
    from vllm.model_executor.layers.linear import LinearLayerBase

    cpu_kernels_available()
    widest = max((m.out_features for m in modules if isinstance(m, LinearLayerBase)), default=0)
    hidden = int(getattr(vllm_config.model_config.hf_config, "hidden_size", 0) or 0)
    tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def heap_bytes(width: int, count: int) -> int:
        # fp32 rows (bf16 products are computed on fp32 copies where the CPU has no bf16
        # GEMM); a tensor over the mmap threshold is mapped, not taken from the heap.
        size = tokens * width * 4
        return count * size if size <= HEAP_ALLOCATION_MAX else 0

    # Live at a layer's peak: the widest projection's output, its activation and a copy, and
    # a handful of hidden-sized rows (residual, norm, attention output, the layer's output,
    # their copies); twice that, because tensors that outlive a step (a stage's pending sends)
    # split the free heap: with 1x, a 2-stage test model still grew stage 0 by 44-57 MiB over
    # its first requests, with 2x by under 1 MiB.
    need = heap_bytes(widest, 3) + heap_bytes(hidden, 8)
    reserved = reserve_heap(2 * need)
    logger.info(
        "stage %d: step activations %.1f MiB reserved (%d tokens)",
        stage,
        reserved / 2**20,
        tokens,
    )
    return reserved
