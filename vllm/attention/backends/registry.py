# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Attention backends selectable by name, imported lazily.

Standard (multi-head / grouped-query) and dense MLA layers: VLLM_ATTENTION_BACKEND, as vLLM names
it - TRITON_ATTN (the Triton paged kernels; for MLA layers the Triton MLA kernel, which
TRITON_MLA also names), FLASHINFER (standard layers, when `flashinfer` is importable and the
layer's shapes fit: head size 64 / 128 / 256, fp16 / bf16; MLA layers take Triton), TORCH_SDPA
(the torch reference, whose CPU path runs the C++ paged kernel). Unset: on CUDA (and ROCm)
FlashInfer where it is importable and fits, else Triton when triton is importable, else the
torch reference; on CPU the torch reference. Triton named on CPU runs in Triton's interpreter,
so it needs TRITON_INTERPRET=1.

Sparse MLA layers (DeepSeek-V3.2 DSA): VLLM_SPARSE_MLA_BACKEND or by device."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

import torch

from vllm import envs
from vllm.logger import init_logger
from vllm.triton_utils import HAS_TRITON, triton_runs_on

if TYPE_CHECKING:
    from vllm.attention.backends.mla.sparse_common import SparseMLACommonImpl
    from vllm.attention.backends.mla.torch_mla import TorchMLAImpl
    from vllm.attention.backends.torch_paged import TorchPagedAttentionImpl

logger = init_logger(__name__)

ATTENTION_BACKENDS: dict[str, tuple[str, str]] = {
    "TORCH_SDPA": ("vllm.attention.backends.torch_paged", "TorchPagedAttentionImpl"),
    "TRITON_ATTN": ("vllm.attention.backends.triton_attn", "TritonPagedAttentionImpl"),
    "FLASHINFER": ("vllm.attention.backends.flashinfer", "FlashInferAttentionImpl"),
}
MLA_BACKENDS: dict[str, tuple[str, str]] = {
    "TORCH_SDPA": ("vllm.attention.backends.mla.torch_mla", "TorchMLAImpl"),
    "TRITON_MLA": ("vllm.attention.backends.mla.triton_mla", "TritonMLAImpl"),
}
# What each VLLM_ATTENTION_BACKEND value means for an MLA layer.
_MLA_NAME = {
    "TORCH_SDPA": "TORCH_SDPA",
    "TRITON_ATTN": "TRITON_MLA",
    "TRITON_MLA": "TRITON_MLA",
    "FLASHINFER": "TRITON_MLA",
}
BACKEND_NAMES = ("TRITON_ATTN", "TRITON_MLA", "FLASHINFER", "TORCH_SDPA")


def _load(table: dict[str, tuple[str, str]], name: str) -> type:
    module, cls_name = table[name]
    return getattr(importlib.import_module(module), cls_name)


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_fits(head_size: int, dtype: torch.dtype) -> bool:
    """FlashInfer's paged prefill / decode kernels cover these head sizes and dtypes."""
    return head_size in (64, 128, 256) and dtype in (torch.float16, torch.bfloat16)


def forced_backend() -> str | None:
    """VLLM_ATTENTION_BACKEND, checked (ValueError naming the variable)."""
    name = envs.VLLM_ATTENTION_BACKEND
    if not name:
        return None
    name = name.strip().upper()
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"VLLM_ATTENTION_BACKEND must be one of {list(BACKEND_NAMES)}, got {name!r}"
        )
    return name


def _check_triton_device(name: str, device: torch.device) -> None:
    if not triton_runs_on(device.type):
        why = "triton is not installed" if not HAS_TRITON else "set TRITON_INTERPRET=1 on CPU"
        raise ValueError(f"VLLM_ATTENTION_BACKEND={name} cannot run on {device.type} here ({why})")


def attention_backend_name(device: torch.device | str, head_size: int, dtype: torch.dtype) -> str:
    """The backend a standard attention layer of this head size and dtype runs on device."""
    device = torch.device(device)
    name = forced_backend()
    if name == "TRITON_MLA":
        name = "TRITON_ATTN"
    if name == "FLASHINFER" and not flashinfer_available():
        raise ValueError("VLLM_ATTENTION_BACKEND=FLASHINFER needs the flashinfer package")
    if name == "FLASHINFER" and not flashinfer_fits(head_size, dtype):
        logger.warning(
            "FlashInfer does not fit head size %d / %s; this layer runs TRITON_ATTN",
            head_size,
            dtype,
        )
        name = "TRITON_ATTN"
    if name in ("TRITON_ATTN", "FLASHINFER"):
        _check_triton_device(name, device)
    if name is not None:
        return name
    if device.type != "cuda":
        return "TORCH_SDPA"
    if flashinfer_available() and flashinfer_fits(head_size, dtype):
        return "FLASHINFER"
    return "TRITON_ATTN" if HAS_TRITON else "TORCH_SDPA"


def mla_backend_name(device: torch.device | str) -> str:
    """The backend a dense MLA layer runs on device."""
    device = torch.device(device)
    name = forced_backend()
    if name is not None:
        name = _MLA_NAME[name]
        if name == "TRITON_MLA":
            _check_triton_device(name, device)
        return name
    if device.type == "cuda" and HAS_TRITON:
        return "TRITON_MLA"
    return "TORCH_SDPA"


def get_attention_impl_cls(name: str) -> type[TorchPagedAttentionImpl]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not registered; choose one of "
            f"{sorted(ATTENTION_BACKENDS)}"
        )
    return _load(ATTENTION_BACKENDS, name)


def get_mla_impl_cls(name: str) -> type[TorchMLAImpl]:
    if name not in MLA_BACKENDS:
        raise ValueError(
            f"MLA backend {name!r} is not registered; choose one of {sorted(MLA_BACKENDS)}"
        )
    return _load(MLA_BACKENDS, name)


_SPARSE_MLA_IMPLS: dict[str, tuple[str, str]] = {
    "TORCH_MLA_SPARSE": ("vllm.attention.backends.mla.torch_mla_sparse", "TorchMLASparseImpl"),
    "TRITON_MLA_SPARSE": (
        "vllm.attention.backends.mla.triton_mla_sparse",
        "TritonMLASparseImpl",
    ),
}


def register_sparse_mla_impl(name: str, module: str, cls_name: str) -> None:
    """Add a sparse backend; its impl class must use SharedTopkIndicesBuffer (tested)."""
    _SPARSE_MLA_IMPLS[name] = (module, cls_name)


def sparse_mla_impl_names() -> list[str]:
    return sorted(_SPARSE_MLA_IMPLS)


def get_sparse_mla_impl_cls(name: str) -> type[SparseMLACommonImpl]:
    if name not in _SPARSE_MLA_IMPLS:
        raise ValueError(
            f"sparse MLA backend {name!r} is not registered; choose one of "
            f"{sparse_mla_impl_names()}"
        )
    return _load(_SPARSE_MLA_IMPLS, name)


def select_sparse_mla_impl(device: torch.device | str) -> type[SparseMLACommonImpl]:
    """VLLM_SPARSE_MLA_BACKEND if set; else Triton on GPUs (CUDA and ROCm) when triton is
    importable, the torch reference otherwise."""
    name = envs.VLLM_SPARSE_MLA_BACKEND
    if name:
        return get_sparse_mla_impl_cls(name)
    if torch.device(device).type == "cuda" and HAS_TRITON:
        return get_sparse_mla_impl_cls("TRITON_MLA_SPARSE")
    return get_sparse_mla_impl_cls("TORCH_MLA_SPARSE")
