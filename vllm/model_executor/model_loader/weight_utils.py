# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Streaming tensors out of a folder of safetensors files (sharded or single)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({root / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir!r}")
    return files


def safetensors_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time."""
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: a missing, unexpected or misshaped weight."""


class TrackedWeights:
    """Checkpoint tensors, counting those a model's loader used (its weights as stored: FP8
    data plus scales for a quantized checkpoint) for the load log."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self.loaded_bytes = 0
        self.loaded_tensors = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._weights)

    def note_loaded(self, tensor: torch.Tensor) -> None:
        self.loaded_bytes += tensor.numel() * tensor.element_size()
        self.loaded_tensors += 1
