# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Mixture of experts: top-k routing, the stacked-experts layer with its (quantizable) weight
methods, the torch reference expert loop, and loading expert weights from either checkpoint
layout (per-expert names, or the fused 3-D tensors HF keeps in memory)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.forward_context import RowKinds
from vllm.model_executor.build_context import current_build_context
from vllm.model_executor.model_loader.weight_utils import WeightLoadError, reject_quantized_tensor

# expert_linear(x, expert, "w13" | "w2", rows) -> x @ W[expert]^T: an expert's product.
ExpertLinear = Callable[[torch.Tensor, int, str, RowKinds | None], torch.Tensor]


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    rows: RowKinds | None,
    expert_linear: ExpertLinear | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]) for every token t.

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k] (any float dtype); topk_ids [T, k]; rows: the kinds of hidden_states'
    rows (the forward context's), passed to every expert product. Each expert is a SwiGLU MLP.
    Only the experts that received tokens run, each once over all of its tokens. Returns [T, H]
    in the dtype of hidden_states, accumulated in float32. expert_linear(x, e, "w13" | "w2",
    rows) computes x @ W[e]^T for weights stored otherwise than dense (quantized); by default
    linear() (BLAS, or the CPU small-M kernel for an expert's few decode rows).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    inter = w2.shape[2]
    if expert_linear is None:
        # Imported here: linear.py -> quantization -> fp8 imports this module.
        from vllm.model_executor.layers.linear import linear

        stacks = {"w13": w13, "w2": w2}

        def expert_linear(
            x: torch.Tensor, e: int, proj: str, rows: RowKinds | None
        ) -> torch.Tensor:
            return linear(x, stacks[proj][e], None, rows)

    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        tokens = token_of[start : start + n]
        gate_up = expert_linear(hidden_states[tokens], expert, "w13", rows)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = expert_linear(act, expert, "w2", rows)
        out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
        start += n
    return out.to(hidden_states.dtype)


class UnquantizedFusedMoEMethod:
    """Dense stacked experts: w13_weight [E, 2I, H] (gate rows, then up) and w2_weight
    [E, H, I] in the compute dtype."""

    def create_weights(
        self,
        layer: FusedMoE,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size
        layer.w13_weight = nn.Parameter(
            torch.empty(e, 2 * i, h, dtype=params_dtype), requires_grad=False
        )
        layer.w2_weight = nn.Parameter(
            torch.empty(e, h, i, dtype=params_dtype), requires_grad=False
        )

    def load_expert_weight(
        self, dst: torch.Tensor, tensor: torch.Tensor, ckpt_name: str, param_name: str
    ) -> None:
        """Copy one checkpoint tensor into its slice `dst` of the stacked parameter."""
        reject_quantized_tensor(ckpt_name, tensor, param_name)
        dst.copy_(tensor.to(dst.dtype))

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def apply(
        self,
        layer: FusedMoE,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        rows: RowKinds | None,
    ) -> torch.Tensor:
        return fused_moe(
            hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, rows
        )


class FusedMoE(nn.Module):
    """The routed experts of a MoE block (the module at `<layer>.mlp.experts`), stacked as
    w13_weight [E, 2I, H] (gate rows, then up) and w2_weight [E, H, I] and stored as the quant
    config of the model being built says (e.g. FP8 with per-block scales). Routing is the
    caller's (select_experts): forward takes the chosen experts and their weights."""

    w13_weight: nn.Parameter
    w2_weight: nn.Parameter
    quant_method: Any  # UnquantizedFusedMoEMethod or a quantization config's MoE method
    # Set by block-FP8 (Fp8MoEMethod) only.
    w13_weight_scale_inv: nn.Parameter
    w2_weight_scale_inv: nn.Parameter
    params_dtype: torch.dtype
    fp8_gemm_scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """intermediate_size is each expert's whole one: with TP a rank holds its slice of
        every expert's columns (w13 rows, w2 columns) and forward returns its partial sum,
        which the caller reduces over the ranks."""
        super().__init__()
        ctx = current_build_context()
        tp = ctx.tp
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({self.tp_size})"
            )
        intermediate_size //= self.tp_size
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        methods = ctx.quant_methods
        self.quant_method = methods.moe() if methods is not None else UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(
            self, num_experts, hidden_size, intermediate_size, torch.get_default_dtype()
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        rows: RowKinds | None,
    ) -> torch.Tensor:
        """rows: the kinds of hidden_states' rows (the forward context's), for every expert
        product."""
        return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids, rows)

    def tp_shard_expert_tensor(
        self, proj: str, fused: bool, tensor: torch.Tensor, scale: bool = False
    ) -> torch.Tensor:
        """This rank's slice of an expert checkpoint tensor (gate / up: its intermediate rows,
        down: its intermediate columns; a fused gate_up keeps its gate rows then up rows), or
        of its block scales (in blocks: each rank's columns must start on a block boundary).
        A tensor of another shape is returned as is (the loader's shape check names it)."""
        if self.tp_size == 1:
            return tensor
        n, r = self.intermediate_size, self.tp_rank
        if scale:
            block = self.quant_method.block[1 if proj == "down_proj" else 0]
            if n % block:
                raise ValueError(
                    f"moe_intermediate_size: a tensor_parallel_size split gives each rank {n} "
                    f"columns of every expert, not a multiple of the checkpoint's "
                    f"weight_block_size ({block}); use a smaller tensor_parallel_size"
                )
            n //= block
        whole = n * self.tp_size
        if proj == "down_proj":
            if tensor.shape[-1] != whole:
                return tensor
            return tensor.narrow(-1, r * n, n)
        axis = 1 if fused else 0
        if proj == "gate_up_proj":
            if tensor.dim() != 3 or tensor.shape[1] != 2 * whole:
                return tensor
            gate, up = tensor.narrow(1, r * n, n), tensor.narrow(1, whole + r * n, n)
            return torch.cat([gate, up], dim=1)
        if tensor.dim() <= axis or tensor.shape[axis] != whole:
            return tensor
        return tensor.narrow(axis, r * n, n)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style top-k routing; returns (topk_weights float32 [T, k], topk_ids [T, k]).

    scoring_func: "softmax" (DeepSeek-V2) or "sigmoid" (DeepSeek-V3). correction_bias (V3's
    e_score_correction_bias) shifts the scores used to choose experts but not the weights.
    With num_expert_group > 1 only the topk_group best groups are eligible; a group scores the
    sum of its two best biased scores when a correction bias is given (V3 "noaux_tc"), else its
    best score (V2 "group_limited_greedy").
    """
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        if topk_group is None:
            raise ValueError(f"num_expert_group={num_expert_group} needs topk_group")
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        # Softmax scores are positive, so 0 excludes a group as -inf would (and matches HF V2).
        fill = float("-inf") if correction_bias is not None else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


# ---- expert weights in checkpoints ----------------------------------------------------------

# `<p>.mlp.experts.{e}.{gate,up,down}_proj.weight` (DeepSeek / Qwen releases) or the fused
# `<p>.mlp.experts.{gate_up_proj,down_proj}` [E, 2I, H] / [E, H, I] (HF's in-memory layout), each
# optionally with a `_scale_inv` block-scale twin. The prefix may be empty (a layer's own dict).
_EXPERT_WEIGHT = re.compile(
    r"^(?P<prefix>(?:.+\.)?mlp\.experts)\."
    r"(?:(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight(?P<scale>_scale_inv)?"
    r"|(?P<fused>gate_up_proj|down_proj)(?P<fused_scale>_scale_inv)?)$"
)

# Which (gate | up | down) slices of an expert a checkpoint tensor of each name fills.
_EXPERT_PARTS = {
    "gate_proj": ("gate",),
    "up_proj": ("up",),
    "down_proj": ("down",),
    "gate_up_proj": ("gate", "up"),
}
_EXPERT_STACKS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


def _expert_target(m: re.Match[str]) -> tuple[str, bool, tuple[str, ...]]:
    """(stacked parameter, is a scale, gate|up|down parts) an expert checkpoint name fills."""
    proj = m["fused"] or m["proj"]
    scale = bool(m["scale"] or m["fused_scale"])
    stack = "w2_weight" if proj == "down_proj" else "w13_weight"
    return f"{m['prefix']}.{stack}{'_scale_inv' if scale else ''}", scale, _EXPERT_PARTS[proj]


def _expert_slices(m: re.Match[str], num_experts: int) -> set[tuple[int, str]]:
    experts = range(num_experts) if m["fused"] else (int(m["expert"]),)
    return {(e, p) for e in experts for p in _expert_target(m)[2]}


class ExpertWeightLoader:
    """Fills the stacked parameters of FusedMoE layers (`*.mlp.experts.w13_weight` /
    `w2_weight`, and for FP8 experts their `*_scale_inv` block scales) from either checkpoint
    layout, each slice through the layer's quant method; a slice filled twice (under two
    names) is an error naming it. check_experts_loaded then finds the slices never filled."""

    def __init__(self) -> None:
        self._filled: dict[str, set[tuple[int, str]]] = {}

    def load(
        self,
        name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        modules: dict[str, nn.Module],
    ) -> bool:
        """Copy one expert checkpoint tensor (already renamed to the model's names); False
        when name is not an expert weight or names no stacked parameter (the caller decides)."""
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            return False
        param_name, scale, parts = _expert_target(m)
        param = params.get(param_name)
        method = getattr(modules.get(m["prefix"]), "quant_method", None)
        if param is None or method is None:
            return False
        num_experts = param.shape[0]
        dst = param.data
        module = modules.get(m["prefix"])
        if isinstance(module, FusedMoE):
            proj = m["fused"] or m["proj"]
            tensor = module.tp_shard_expert_tensor(proj, bool(m["fused"]), tensor, scale)
        if not m["fused"]:
            e = int(m["expert"])
            if e >= num_experts:
                raise WeightLoadError(
                    f"checkpoint weight {name!r} names expert {e} but {param_name!r} holds "
                    f"{num_experts} experts"
                )
            # Scales of w13 stack the gate's grid over the up projection's, as weights stack.
            half = param.shape[1] // 2
            dst = {"gate": dst[e, :half], "up": dst[e, half:], "down": dst[e]}[parts[0]]
        if tuple(tensor.shape) != tuple(dst.shape):
            what = "block scale" if scale else "weight"
            raise WeightLoadError(
                f"{what} {name!r} has shape {tuple(tensor.shape)} in the checkpoint but the "
                f"model expects {tuple(dst.shape)} (a slice of {param_name!r})"
            )
        filled = self._filled.setdefault(param_name, set())
        slices = _expert_slices(m, num_experts)
        twice = slices & filled
        if twice:
            e, p = min(twice)
            raise WeightLoadError(
                f"expert weight {m['prefix']}.{e}.{p}_proj.weight{'_scale_inv' if scale else ''} "
                f"is loaded twice (again by {name!r})"
            )
        with torch.no_grad():
            method.load_expert_weight(dst, tensor, name, param_name)
        filled |= slices
        return True


def check_experts_loaded(
    model: nn.Module, loaded: set[str], is_missing_here: Callable[[str], bool]
) -> None:
    """Raise naming every expert slice of model no name in loaded filled (an FP8 slice without
    its scale by both names), skipping parameters is_missing_here says another stage holds;
    add every complete stack to loaded."""
    params = dict(model.named_parameters())
    filled: dict[str, set[tuple[int, str]]] = {}
    for name in loaded:
        m = _EXPERT_WEIGHT.match(name)
        param_name = _expert_target(m)[0] if m is not None else None
        if m is not None and param_name in params:
            slices = _expert_slices(m, params[param_name].shape[0])
            filled.setdefault(param_name, set()).update(slices)
    missing: list[str] = []
    for param_name, param in params.items():
        prefix, _, leaf = param_name.rpartition(".")
        if not prefix.endswith("mlp.experts") or leaf not in _EXPERT_STACKS:
            continue
        if is_missing_here(param_name):
            continue
        parts = ("down",) if leaf.startswith("w2_") else ("gate", "up")
        suffix = "_scale_inv" if leaf.endswith("_scale_inv") else ""
        done = filled.get(param_name, set())
        absent = [
            f"{prefix}.{e}.{p}_proj.weight{suffix}"
            for e in range(param.shape[0])
            for p in parts
            if (e, p) not in done
        ]
        if absent:
            missing += absent
        else:
            loaded.add(param_name)
    if not missing:
        return
    lone = [
        n for n in missing if n.endswith("_scale_inv") and n[: -len("_scale_inv")] not in missing
    ]
    if lone:
        more = f" (+{len(lone) - 4} more)" if len(lone) > 4 else ""
        pairs = [f"{n[:-10]!r} without {n!r}" for n in lone[:4]]
        raise WeightLoadError(
            f"checkpoint expert weight(s) of {type(model).__name__} are FP8 but their block "
            f"scales are missing: {', '.join(pairs)}{more}"
        )
    more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
    raise WeightLoadError(
        f"checkpoint is missing expert weight(s) for {type(model).__name__}: {missing[:8]}{more}"
    )


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF transformers keeps experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
    gate rows then up rows; `mlp.experts.down_proj` [E, H, I]); checkpoints name them per
    expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`). Other names pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None or m["fused"] is None or m["fused_scale"]:
            out[name] = tensor
        elif m["fused"] == "gate_up_proj":
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{m['prefix']}.{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                out[f"{m['prefix']}.{e}.up_proj.weight"] = tensor[e, inter:].clone()
        else:
            for e in range(tensor.shape[0]):
                out[f"{m['prefix']}.{e}.down_proj.weight"] = tensor[e].clone()
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of split_fused_experts (per-expert names -> fused 3-D tensors)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = _EXPERT_WEIGHT.match(name)
        if m is None or m["expert"] is None or m["scale"]:
            out[name] = tensor
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["expert"])] = tensor
    for prefix, projs in groups.items():
        n = len(projs["down_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out
