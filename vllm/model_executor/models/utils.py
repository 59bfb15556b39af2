# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Shared model-building helpers: PP placeholders, layer slicing, strict weight loading."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from vllm.distributed.parallel_state import get_pp_group
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.layers.quantization.fp8 import FP8_DTYPES
from vllm.model_executor.model_loader.weight_utils import WeightLoadError
from vllm.sequence import IntermediateTensors


class PPMissingLayer(nn.Identity):
    """Placeholder for a layer another pipeline stage owns; returns its first input."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, *args, **kwargs):
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


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """True when the weight belongs to a layer this stage does not hold."""
    names = getattr(model, "_pp_missing_names", None)
    if names is None:
        names = get_pp_missing_layer_names(model)
        model._pp_missing_names = names
    return any(name.startswith(p) for p in names)


def make_empty_intermediate_tensors_factory(keys: list[str], hidden_size: int):
    def make(batch_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        return IntermediateTensors(
            {k: torch.zeros(batch_size, hidden_size, dtype=dtype, device=device) for k in keys}
        )

    return make


def reject_quantized_tensor(ckpt_name: str, tensor: torch.Tensor, param_name: str) -> None:
    """A quantized (FP8) checkpoint tensor may only fill a quantized layer: cast into a plain
    parameter it would silently lose its scale."""
    if tensor.dtype in FP8_DTYPES:
        raise WeightLoadError(
            f"checkpoint weight {ckpt_name!r} is stored quantized ({tensor.dtype}) but "
            f"{param_name!r} is not a quantized parameter (does config.json lack its "
            "quantization_config, or is this layer never quantized?)"
        )


def load_params_strict(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda n: n,
    shared: Iterable[str] = (),
    custom: Callable[[str, torch.Tensor, dict[str, nn.Parameter]], bool] | None = None,
) -> set[str]:
    """Copy checkpoint tensors into the model's parameters, strictly.

    rename maps a checkpoint name to a parameter name (None: skip the weight on purpose).
    custom(name, tensor, params) may consume a weight itself (stacked/expert tensors) and returns
    True when it did. A layer with a quant_method (quantized linears) loads its own weights and
    scales. Every parameter must be loaded exactly once unless it is listed in shared
    (tied/derived) or lives in a layer of another pipeline stage. Misshaped, unknown or missing
    weights raise WeightLoadError naming them. When weights has a note_loaded(tensor) method it
    is told about every tensor this stage used (the loader's memory report).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    note_loaded = getattr(weights, "note_loaded", None)
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None or is_pp_missing_parameter(name, model):
            continue
        if name in loaded:
            raise WeightLoadError(f"weight {ckpt_name!r} appears twice in the checkpoint")
        if note_loaded is not None:
            note_loaded(tensor)
        if custom is not None and custom(name, tensor, params):
            loaded.add(name)
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = modules.get(owner_name)
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
    return loaded


def check_all_loaded(model: nn.Module, loaded: set[str], shared: Iterable[str] = ()) -> None:
    """Raise naming every parameter of this stage that no checkpoint weight filled (first each
    quantized layer checks its weight against its scales)."""
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "finish_loading"):
            method.finish_loading(module, prefix, loaded)
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


EAGLE_FAMILY_METHODS = ("eagle", "eagle3")


def spec_decode_needs_target_embed(vllm_config) -> bool:
    """Whether the target must keep `embed_tokens` on this stage for its draft.

    An EAGLE-family draft that ships no embedding shares the target's; the draft lives on the
    last stage, where the target's table is otherwise a PPMissingLayer (unless tied). True only
    for P > 1, on the last rank, with method eagle / eagle3 (MTP drafts load their own table).
    """
    spec = getattr(vllm_config, "speculative_config", None) if vllm_config is not None else None
    if spec is None or getattr(spec, "method", None) not in EAGLE_FAMILY_METHODS:
        return False
    pp = get_pp_group()
    return pp.world_size > 1 and pp.is_last_rank


def init_pp_decoder(
    module: nn.Module,
    config,
    layer_fn: Callable[[str], nn.Module],
    norm_fn: Callable[[], nn.Module],
    prefix: str,
    embed_on_last: bool = False,
) -> None:
    """The pipeline-stage skeleton every decoder shares: embed_tokens on the first stage (and
    on the last when embed_on_last: tied weights, or an EAGLE draft there), this stage's layers
    (PPMissingLayer elsewhere), the final norm on the last stage, and the factory for the
    hidden_states/residual tensors that travel between stages."""
    pp = get_pp_group()
    if pp.is_first_rank or (embed_on_last and pp.is_last_rank):
        module.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    else:
        module.embed_tokens = PPMissingLayer()
    module.start_layer, module.end_layer, module.layers = make_layers(
        int(config.num_hidden_layers), layer_fn, prefix=f"{prefix}.layers"
    )
    module.norm = norm_fn() if pp.is_last_rank else PPMissingLayer()
    module.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
        ["hidden_states", "residual"], config.hidden_size
    )
