# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The memory-mapped checkpoint reader (what a tensor-parallel rank loads through) yields the
same names, dtypes, shapes and values as safetensors' own, for every stored dtype, and its
views survive the file being closed and can be written without touching the file."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from vllm.model_executor.model_loader.weight_utils import (
    safetensors_mmap_iterator,
    safetensors_weights_iterator,
)


def test_mmap_iterator_equals_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.weight": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "c.half": torch.randn(4, generator=g).to(torch.float16),
        "d.fp8": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
        "e.ids": torch.arange(11, dtype=torch.int64),
        "f.mask": torch.tensor([True, False, True]),
        "g.empty": torch.zeros(0, 4),
        "h.scalar": torch.tensor(3.5),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ref = dict(safetensors_weights_iterator(str(tmp_path)))
    got = dict(safetensors_mmap_iterator(str(tmp_path)))
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    before = (tmp_path / "model.safetensors").read_bytes()
    got["a.weight"].narrow(0, 2, 3).mul_(0)  # a private copy: the file is untouched
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert torch.equal(got["a.weight"][2:5], torch.zeros(3, 5))
