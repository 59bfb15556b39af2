# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Attention backends selectable by name: the sparse MLA impls (DeepSeek-V3.2 DSA), imported
lazily, chosen by VLLM_SPARSE_MLA_BACKEND or by device."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from vllm import envs

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.sparse_common import SparseMLACommonImpl

_SPARSE_MLA_IMPLS: dict[str, tuple[str, str]] = {
    "TORCH_MLA_SPARSE": ("vllm.v1.attention.backends.mla.torch_mla_sparse", "TorchMLASparseImpl"),
    "TRITON_MLA_SPARSE": (
        "vllm.v1.attention.backends.mla.triton_mla_sparse",
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
    module, cls_name = _SPARSE_MLA_IMPLS[name]
    return getattr(importlib.import_module(module), cls_name)


def select_sparse_mla_impl(device: torch.device | str) -> type[SparseMLACommonImpl]:
    """VLLM_SPARSE_MLA_BACKEND if set; else Triton on GPUs (CUDA and ROCm) when triton is
    importable, the torch reference otherwise."""
    name = envs.VLLM_SPARSE_MLA_BACKEND
    if name:
        return get_sparse_mla_impl_cls(name)
    if torch.device(device).type == "cuda":
        from vllm.v1.attention.backends.mla.triton_mla_sparse import HAS_TRITON

        if HAS_TRITON:
            return get_sparse_mla_impl_cls("TRITON_MLA_SPARSE")
    return get_sparse_mla_impl_cls("TORCH_MLA_SPARSE")
