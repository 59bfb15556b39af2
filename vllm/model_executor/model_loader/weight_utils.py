# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Streaming tensors out of a folder of safetensors files (sharded or single)."""

from __future__ import annotations

import json
import mmap
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


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def safetensors_mmap_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Like safetensors_weights_iterator, but each tensor is a view of a private (copy on
    write) memory map of its file: nothing is read until used, so a tensor-parallel rank that
    copies out only its rows of a tensor reads only the file pages holding them (its columns:
    the pages each row's part lies in). Views stay valid as long as they are referenced."""
    for f in safetensors_files(model_dir):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{f}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            count = (end - start) // torch.empty(0, dtype=dtype).element_size()
            if count == 0:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start)
            yield name, flat.view(shape)


def safetensors_weight_names(model_dir: str) -> set[str]:
    """Names of every tensor in the checkpoint (headers only; no tensor is read)."""
    names: set[str] = set()
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            names.update(fh.keys())
    return names


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: a missing, unexpected or misshaped weight."""


# Every 8-bit float a checkpoint could hold: one reaching a layer that is not FP8 is an error.
FP8_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def reject_quantized_tensor(ckpt_name: str, tensor: torch.Tensor, param_name: str) -> None:
    """A quantized (FP8) checkpoint tensor may only fill a quantized layer: cast into a plain
    parameter it would silently lose its scale."""
    if tensor.dtype in FP8_DTYPES:
        raise WeightLoadError(
            f"checkpoint weight {ckpt_name!r} is stored quantized ({tensor.dtype}) but "
            f"{param_name!r} is not a quantized parameter (does config.json lack its "
            "quantization_config, or is this layer never quantized?)"
        )


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
