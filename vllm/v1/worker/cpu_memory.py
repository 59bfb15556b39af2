# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Process-wide memory settings of a CPU worker, so that its resident memory after start-up
(pools touched, warm-up run) is what it keeps under load.

Two things grew a CPU stage's memory for thousands of requests after start-up:
- oneDNN's primitive cache and PyTorch's ideep cache keep one entry (~0.5 MiB) per GEMM shape,
  up to 1024 each, and every new batch size is a new shape: both are bounded here.
- glibc's malloc starts by mmapping large blocks and raises that threshold (up to 32 MiB) the
  first time one is freed, after which activations of that size come from the heap, which then
  grows past what start-up used. The thresholds are fixed at the values it converges to, so the
  start-up warm-up already grows the heap to what steps need. Returning large blocks to the
  system on every free instead costs a page fault per 4 KiB touched on every step (~30x the
  time of reusing heap memory for a 3 MiB activation, measured).

Once the model is loaded, the mmap threshold is lowered to the size of the largest activation
of the start-up warm-up's prefill step (bound_heap_allocations): every activation up to that
size (decode, verify and small prefill steps) is reused from the heap that the warm-up grew,
and the larger ones of bigger prefill steps are mapped for the step and returned after it.
The heap then never grows past what the warm-up left, without replaying a full token budget at
start-up; a prefill step pays the page faults of its large activations (their zeroing is one
write pass over memory that a GEMM of hundreds of products per element then fills).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)

# glibc's mallopt parameters and its largest mmap threshold on 64-bit (4 MiB * sizeof(long)).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20

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


# Below this, a lowered threshold would map allocations a decode step makes many of.
_MMAP_THRESHOLD_MIN = 256 * 2**10


def bound_heap_allocations(max_bytes: int) -> int:
    """Serve allocations larger than max_bytes (clamped to [256 KiB, 32 MiB]) by mmap from now
    on: the heap keeps only what is at most that large. Returns the threshold set (0: the C
    library has no mallopt, or refused)."""
    mallopt = _mallopt()
    threshold = min(max(int(max_bytes), _MMAP_THRESHOLD_MIN), _MMAP_THRESHOLD_MAX)
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, threshold):
        logger.debug("mmap threshold left as it is")
        return 0
    return threshold


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
