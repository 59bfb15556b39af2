# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What every Triton kernel of the engine shares: the optional import, and kernels jitted on
first launch.

Triton is optional (CPU-only installs run without it; GPU builds of torch bring it). Importing a
module that defines kernels never needs triton; launching one does. Kernels are plain functions
wrapped by `LazyKernel`, jitted when first launched: triton decides at jit time whether a kernel
runs compiled (CUDA, ROCm) or in its CPU interpreter (TRITON_INTERPRET=1), so a process that
sets the variable after importing the engine (a test) still gets the interpreter. Triton's own
@jit library functions (tl.sum, tl.max, tl.zeros, ...) are made when triton is first imported,
compiled-mode ones if the variable was unset then; an interpreted launch swaps in interpreted
copies of them for its duration (`_interpreted_stdlib`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vllm import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "LayerOpsRoute",
    "LazyKernel",
    "dot_upcast",
    "next_pow2",
    "require_triton",
    "tl",
    "triton",
    "triton_runs_on",
    "use_triton_layer_ops",
]


def next_pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor) (tl.arange extents must be powers of two)."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels must hand tl.dot fp32 copies of their bf16 operands: Triton's CPU
    interpreter (3.9) multiplies bf16 dot operands as raw 16-bit integers. The copies hold the
    same values and bf16 products are exact in fp32, so results match the compiled bf16 dot
    (which accumulates in fp32 too); compiled kernels keep bf16 operands (tensor cores). (The
    interpreter also truncates fp32 -> bf16 casts where GPUs round to nearest: tests of bf16
    outputs allow one bf16 ulp.)"""
    return dtype == torch.bfloat16 and bool(envs.TRITON_INTERPRET)


def require_triton(what: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            f"{what} needs the triton package (GPU builds of torch bring it; pip install triton)"
        )


def triton_runs_on(device_type: str) -> bool:
    """Whether Triton kernels can run on tensors of this device type here: compiled on CUDA
    (and ROCm, which torch also calls cuda), interpreted on CPU under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and bool(envs.TRITON_INTERPRET)


def use_triton_layer_ops(device_type: str) -> bool:
    """Whether RMSNorm and rotary run their Triton kernels on this device: always on CUDA when
    triton is importable (the CUDA path); on CPU only when a Triton attention backend is forced
    under the interpreter (VLLM_ATTENTION_BACKEND=TRITON_*, TRITON_INTERPRET=1: the CUDA path's
    kernels, checked on CPU). Otherwise the CPU path keeps its C++ / torch kernels."""
    if device_type == "cuda":
        return HAS_TRITON
    if device_type != "cpu" or not HAS_TRITON or not envs.TRITON_INTERPRET:
        return False
    return (envs.VLLM_ATTENTION_BACKEND or "").upper().startswith("TRITON")


class LayerOpsRoute:
    """use_triton_layer_ops for one layer (a norm, a rotary embedding): the CPU answer is read
    from the environment at the layer's first CPU forward and kept, so every later call pays
    an attribute read instead of two environment lookups (~8 us per call on a slow core, three
    calls per decoder layer). An engine's environment is set before it builds its layers, as
    the attention backend's choice at build time already assumes."""

    __slots__ = ("_cpu",)

    def __init__(self) -> None:
        self._cpu: bool | None = None

    def __call__(self, x: torch.Tensor) -> bool:
        if not x.is_cpu:
            return use_triton_layer_ops(x.device.type)
        if self._cpu is None:
            self._cpu = use_triton_layer_ops("cpu")
        return self._cpu


_INTERPRETED: dict[int, Any] = {}


@contextmanager
def _interpreted_stdlib() -> Iterator[None]:
    """triton.language's @jit library functions as interpreted functions while an interpreted
    kernel runs, when triton was imported in compiled mode (they would refuse to be called)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved: list[tuple[Any, str, Any]] = []
    for mod_name in ("triton.language", "triton.language.standard", "triton.language.math"):
        mod = importlib.import_module(mod_name)
        for name, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                key = id(value)
                if key not in _INTERPRETED:
                    _INTERPRETED[key] = InterpretedFunction(value.fn)
                saved.append((mod, name, value))
                setattr(mod, name, _INTERPRETED[key])
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


class LazyKernel:
    """A Triton kernel jitted on first launch, once per interpreter setting:
    `KERNEL[grid](*args, **constexprs)` as with a @triton.jit function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        require_triton(self.fn.__name__)
        interpret = bool(envs.TRITON_INTERPRET)
        kernel = self._jitted.get(interpret)
        if kernel is None:
            kernel = self._jitted[interpret] = triton.jit(self.fn)
        launch = kernel[grid]
        if not interpret:
            return launch

        def run(*args: Any, **kwargs: Any) -> Any:
            with _interpreted_stdlib():
                return launch(*args, **kwargs)

        return run
