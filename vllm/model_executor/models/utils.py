# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Shared model-building helpers: PP placeholders, layer slicing, strict weight loading."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm.distributed.parallel_state import get_pp_group
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.layers.fused_moe import ExpertWeightLoader, check_experts_loaded
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    TPSharded,
)
from vllm.model_executor.model_loader.weight_utils import WeightLoadError, reject_quantized_tensor
from vllm.sequence import IntermediateTensors


class PPMissingLayer(nn.Identity):
    """Placeholder for a layer another pipeline stage owns; returns its first input."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()), None)


def maybe_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def make_layers(
    num_hidden_layers: int, layer_fn: Callable[[str], nn.Module], prefix: str
) -> tuple[int, int, nn.ModuleList]:
    """Build this stage's layers; other stages' slots hold PPMissingLayer (global indices kept)."""
    pp = get_pp_group()
    start, end = get_pp_indices(num_hidden_layers, pp.rank, pp.world_size)
    layers = [
        layer_fn(f"{prefix}.{i}") if start <= i < end else PPMissingLayer()
        for i in range(num_hidden_layers)
    ]
    return start, end, nn.ModuleList(layers)


def get_pp_missing_layer_names(model: nn.Module) -> list[str]:
    return [name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer)]


_PP_MISSING_NAMES: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """True when the weight belongs to a layer this stage does not hold."""
    names = _PP_MISSING_NAMES.get(model)
    if names is None:
        # Which layers a stage holds never changes once it is built.
        names = _PP_MISSING_NAMES[model] = get_pp_missing_layer_names(model)
    return any(name.startswith(p) for p in names)


IntermediateTensorsFactory = Callable[[int, torch.dtype, torch.device], IntermediateTensors]


def make_empty_intermediate_tensors_factory(
    keys: Iterable[str], hidden_size: int
) -> IntermediateTensorsFactory:
    """make(batch_size, dtype, device): zeros [batch_size, hidden_size] for each key."""
    keys = tuple(keys)

    def make(batch_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        return IntermediateTensors(
            {k: torch.zeros(batch_size, hidden_size, dtype=dtype, device=device) for k in keys}
        )

    return make


def load_params_strict(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda n: n,
    shared: Iterable[str] = (),
    custom: Callable[[str, torch.Tensor, dict[str, nn.Parameter]], bool] | None = None,
) -> set[str]:
    """Copy checkpoint tensors into the model's parameters, strictly.

    rename maps a checkpoint name to a parameter name (None: skip the weight on purpose).
    custom(name, tensor, params) may consume a weight itself and returns True when it did.
    Routed-expert tensors (either layout) fill their FusedMoE stacks; a layer with a
    quant_method (quantized linears) loads its own weights and scales. Every parameter must be
    loaded exactly once unless it is listed in shared (tied/derived) or lives in a layer of
    another pipeline stage. Misshaped or unknown weights raise WeightLoadError naming them,
    missing ones check_all_loaded. When weights has a
    note_loaded(tensor) method it is told about every tensor this stage used (the loader's
    memory report). Returns the names loaded (parameters, and checkpoint names of the expert
    slices).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    stacked = stacked_params_mapping(modules)
    shards_done: dict[str, set[int]] = {}
    note_loaded = getattr(weights, "note_loaded", None)
    experts = ExpertWeightLoader()
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None or is_pp_missing_parameter(name, model):
            continue
        if name in loaded:
            raise WeightLoadError(f"weight {ckpt_name!r} appears twice in the checkpoint")
        if note_loaded is not None:
            note_loaded(tensor)
        if (custom is not None and custom(name, tensor, params)) or experts.load(
            name, tensor, params, modules
        ):
            loaded.add(name)
            continue
        owner_name, _, leaf = name.rpartition(".")
        if owner_name in stacked:
            merged_name, shard = stacked[owner_name]
            merged = modules[merged_name]
            if isinstance(merged, MergedColumnParallelLinear):
                tensor = merged.tp_shard_checkpoint_tensor(shard, tensor, leaf)
            if merged.shards is not None:  # quantized: the shard is a layer of its own
                owner_name = f"{merged_name}.shards.{shard}"
            else:
                loaded.add(name)
                packed = f"{merged_name}.{leaf}"
                _load_packed_shard(merged, shard, leaf, tensor, ckpt_name, packed, params)
                done = shards_done.setdefault(packed, set())
                done.add(shard)
                if len(done) == len(merged.shard_names):
                    loaded.add(packed)
                continue
            name = f"{owner_name}.{leaf}"
        owner = modules.get(owner_name)
        if isinstance(owner, TPSharded):
            # This rank's part of the whole checkpoint tensor (a view: only it is copied).
            tensor = owner.tp_shard_checkpoint_tensor(leaf, tensor)
        load_weight = getattr(getattr(owner, "quant_method", None), "load_weight", None)
        with torch.no_grad():
            if load_weight is not None and load_weight(owner, leaf, tensor, ckpt_name):
                loaded.add(name)
                continue
        param = params.get(name)
        if param is None:
            raise WeightLoadError(
                f"checkpoint weight {ckpt_name!r} has no matching parameter ({name!r}) in "
                f"{type(model).__name__}"
            )
        if tuple(param.shape) != tuple(tensor.shape):
            raise WeightLoadError(
                f"weight {ckpt_name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
                f"the model expects {tuple(param.shape)}"
            )
        reject_quantized_tensor(ckpt_name, tensor, name)
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    _check_packed_shards(model, stacked, modules, shards_done)
    return loaded


def _check_packed_shards(
    model: nn.Module,
    stacked: dict[str, tuple[str, int]],
    modules: dict[str, nn.Module],
    shards_done: dict[str, set[int]],
) -> None:
    """A packed layer that got some of its shards but not all names the missing checkpoint
    weight (a layer that got none is reported by check_all_loaded)."""
    for ckpt_module, (merged_name, shard) in stacked.items():
        if modules[merged_name].shards is not None:
            continue
        for leaf in ("weight", "bias"):
            done = shards_done.get(f"{merged_name}.{leaf}")
            if done and shard not in done and not is_pp_missing_parameter(merged_name, model):
                raise WeightLoadError(
                    f"checkpoint is missing weight {ckpt_module}.{leaf!s} (a shard of "
                    f"{merged_name}.{leaf}) for {type(model).__name__}"
                )


def stacked_params_mapping(modules: dict[str, nn.Module]) -> dict[str, tuple[str, int]]:
    """Checkpoint module name -> (packed layer, shard index) for every MergedReplicatedLinear
    of the model (e.g. `...self_attn.k_proj` -> (`...self_attn.qkv_proj`, 1)): the checkpoint
    keeps the projections apart, the model packs them."""
    out: dict[str, tuple[str, int]] = {}
    for name, m in modules.items():
        if isinstance(m, MergedReplicatedLinear):
            parent = name.rpartition(".")[0]
            for i, shard in enumerate(m.shard_names):
                out[f"{parent}.{shard}" if parent else shard] = (name, i)
    return out


def _load_packed_shard(
    merged: MergedReplicatedLinear,
    shard: int,
    leaf: str,
    tensor: torch.Tensor,
    ckpt_name: str,
    packed_name: str,
    params: dict[str, nn.Parameter],
) -> None:
    param = params.get(packed_name)
    if param is None:
        have = sorted(n for n, _ in merged.named_parameters())
        raise WeightLoadError(
            f"checkpoint weight {ckpt_name!r} has no matching parameter in the packed layer "
            f"{packed_name.rpartition('.')[0]!r} (it has {have})"
        )
    start, rows = merged.shard_rows(shard)
    expected = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise WeightLoadError(
            f"weight {ckpt_name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
            f"the model expects {expected} (rows {start}:{start + rows} of {packed_name!r})"
        )
    reject_quantized_tensor(ckpt_name, tensor, packed_name)
    with torch.no_grad():
        param.narrow(0, start, rows).copy_(tensor.to(param.dtype))


def check_all_loaded(model: nn.Module, loaded: set[str], shared: Iterable[str] = ()) -> None:
    """Raise naming every parameter of this stage that no checkpoint weight filled (first each
    quantized layer checks its weight against its scales, and every expert slice is checked)."""
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "finish_loading"):
            method.finish_loading(module, prefix, loaded)
    check_experts_loaded(model, loaded, lambda n: is_pp_missing_parameter(n, model))
    shared = set(shared)
    missing = [
        n
        for n, _ in model.named_parameters()
        if n not in loaded and n not in shared and not is_pp_missing_parameter(n, model)
    ]
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise WeightLoadError(
            f"checkpoint is missing weight(s) for {type(model).__name__}: {missing[:8]}{more}"
        )
