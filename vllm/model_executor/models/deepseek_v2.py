# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V2 / V3: multi-head latent attention (latent KV cache) and routed + shared experts."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.distributed.parallel_state import get_pp_group
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod, select_experts
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization import get_current_quant_config
from vllm.model_executor.layers.quantization.fp8 import FP8_DTYPE, load_fp8_tensor
from vllm.model_executor.layers.rotary_embedding import get_rope, rope_params, yarn_get_mscale
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    WeightLoadError,
    check_all_loaded,
    init_pp_decoder,
    is_pp_missing_parameter,
    load_params_strict,
    maybe_prefix,
    reject_quantized_tensor,
    spec_decode_needs_target_embed,
)
from vllm.sequence import IntermediateTensors


def get_spec_layer_idx_from_weight_name(config: Any, weight_name: str) -> int | None:
    """The MTP layer index L of a checkpoint weight `model.layers.{L}.*`, else None.

    MTP layers follow the decoder layers: num_hidden_layers <= L < num_hidden_layers +
    num_nextn_predict_layers.
    """
    num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if num_mtp <= 0 or not weight_name.startswith("model.layers."):
        return None
    idx = weight_name.split(".", 3)[2]
    if not idx.isdigit():
        return None
    layer = int(idx)
    first = int(config.num_hidden_layers)
    return layer if first <= layer < first + num_mtp else None


def _is_v2(config: Any) -> bool:
    return getattr(config, "model_type", None) == "deepseek_v2"


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Routed experts in this layer (also for MTP layers, whose index is >= num_hidden_layers)."""
    # V3.2 / GLM-DSA configs may spell the pattern out; MTP layers lie past its end.
    types = getattr(config, "mlp_layer_types", None)
    if types is not None and layer_idx < len(types):
        return types[layer_idx] == "sparse"
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    return (
        bool(getattr(config, "n_routed_experts", None))
        and layer_idx >= int(getattr(config, "first_k_dense_replace", 0) or 0)
        and layer_idx % freq == 0
    )


def _check_act(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for DeepSeek models (only 'silu')")


class DeepseekV2MoEGate(nn.Module):
    """Router weights; V3 ("noaux_tc") adds a per-expert bias used only to choose experts."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if correction_bias:
            # Kept in float32 whatever the model dtype (as HF does): it breaks near-ties.
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Router logits in float32 [T, E]."""
        return nn.functional.linear(hidden_states.float(), self.weight.float())


class DeepseekV2Experts(nn.Module):
    """Routed experts stacked as w13_weight [E, 2I, H] (gate rows, then up) and w2_weight, stored
    as the model's quant config says (e.g. FP8 with per-block scales)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        config = get_current_quant_config()
        self.quant_method = (
            config.get_moe_method() if config is not None else UnquantizedFusedMoEMethod()
        )
        self.quant_method.create_weights(
            self, num_experts, hidden_size, intermediate_size, torch.get_default_dtype()
        )

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)


class DeepseekV2MoE(nn.Module):
    """Routed experts plus always-on shared experts (n_shared_experts * moe_intermediate_size)."""

    def __init__(self, config: Any, prefix: str = "") -> None:
        super().__init__()
        _check_act(config)
        v2 = _is_v2(config)
        self.top_k = int(config.num_experts_per_tok)
        num_experts = int(config.n_routed_experts)
        # HF's V2/V3 configs lack these keys (the classes hard-code them); real checkpoints
        # spell them out: V2 softmax + greedy / group_limited_greedy, V3 sigmoid + noaux_tc.
        self.scoring_func = getattr(config, "scoring_func", None) or (
            "softmax" if v2 else "sigmoid"
        )
        topk_method = getattr(config, "topk_method", None) or ("greedy" if v2 else "noaux_tc")
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {topk_method!r} is not supported")
        grouped = topk_method != "greedy"
        self.num_expert_group = getattr(config, "n_group", None) if grouped else None
        self.topk_group = getattr(config, "topk_group", None) if grouped else None
        if self.num_expert_group and self.num_expert_group > 1:
            if num_experts % self.num_expert_group or not self.topk_group:
                raise ValueError(
                    f"n_routed_experts={num_experts} must split into n_group="
                    f"{self.num_expert_group} groups and topk_group must be set "
                    f"(got {self.topk_group!r})"
                )
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        self.gate = DeepseekV2MoEGate(config.hidden_size, num_experts, topk_method == "noaux_tc")
        self.experts = DeepseekV2Experts(
            num_experts, config.hidden_size, int(config.moe_intermediate_size)
        )
        n_shared = int(getattr(config, "n_shared_experts", 0) or 0)
        if n_shared:
            self.shared_experts = LlamaMLP(
                config.hidden_size,
                int(config.moe_intermediate_size) * n_shared,
                bool(getattr(config, "mlp_bias", False)),
            )
        else:
            self.shared_experts = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(
            self.gate(hidden_states),
            self.top_k,
            scoring_func=self.scoring_func,
            correction_bias=self.gate.e_score_correction_bias,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        out = self.experts(hidden_states, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def mla_softmax_scale(config: Any) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under scaled RoPE."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    _, scaling = rope_params(config)
    if scaling is not None:
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(float(scaling["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


class DeepseekV2MLAAttention(nn.Module):
    """MLA: queries (optionally low-rank), one shared latent kv_c plus a shared rotary key."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = int(config.num_attention_heads)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ReplicatedLinear(h, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=bias)
            # HF and the reference code use the default eps (not rms_norm_eps) for the latents.
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = ReplicatedLinear(
                self.q_lora_rank, self.num_heads * qk_head_dim, bias=False
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ReplicatedLinear(
            self.kv_lora_rank,
            self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False,
        )
        self.o_proj = ReplicatedLinear(self.num_heads * self.v_head_dim, h, bias=bias)
        theta, scaling = rope_params(config)
        # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)...; V2 always, V3 unless the
        # checkpoint's rope_interleave is false. q_pe and k_pe share the layout, so their dot
        # products equal HF's whichever order HF writes the rotated pairs in.
        interleaved = True if _is_v2(config) else bool(getattr(config, "rope_interleave", True))
        self.rotary_emb = get_rope(
            self.qk_rope_head_dim,
            self.qk_rope_head_dim,
            int(config.max_position_embeddings),
            theta,
            is_neox_style=not interleaved,
            scaling=scaling,
        )
        self.attn = MLAAttention(
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            mla_softmax_scale(config),
            self.kv_b_proj,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe, _ = self.project(positions, hidden_states)
        return self.o_proj(self.attn(q_nope, q_pe, kv_c, k_pe))

    def project(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_nope, rotated q_pe, normed kv_c, rotated k_pe, q latent or None without q LoRA)."""
        q_c = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q_c = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_c)
        q = q.view(q.shape[0], self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        return q_nope, q_pe, kv_c, k_pe, q_c


class DeepseekV2DecoderLayer(nn.Module):
    """One decoder block; layer_idx may be an MTP layer's (>= num_hidden_layers)."""

    def __init__(
        self,
        config: Any,
        prefix: str,
        layer_idx: int | None = None,
        self_attn: nn.Module | None = None,
    ) -> None:
        """self_attn: a prebuilt attention block (V3.2 passes its sparse one), else plain MLA."""
        super().__init__()
        if layer_idx is None:
            layer_idx = int(prefix.rsplit(".", 1)[-1])
        self.layer_idx = layer_idx
        eps = getattr(config, "rms_norm_eps", 1e-6)
        if self_attn is None:
            self_attn = DeepseekV2MLAAttention(config, prefix=f"{prefix}.self_attn")
        self.self_attn = self_attn
        if is_moe_layer(config, layer_idx):
            self.mlp = DeepseekV2MoE(config, prefix=f"{prefix}.mlp")
        else:
            _check_act(config)
            self.mlp = LlamaMLP(
                config.hidden_size,
                int(config.intermediate_size),
                bool(getattr(config, "mlp_bias", False)),
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the fused residual stream: returns (mlp output, residual)."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attn_out = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(hidden_states), residual


_EXPERT_WEIGHT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\."
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


class ExpertWeightLoader:
    """Fills stacked expert parameters (`*.mlp.experts.w13_weight` / `w2_weight`, and for FP8
    experts their `*_scale_inv` block scales).

    Accepts per-expert checkpoint names `<p>.mlp.experts.{e}.{gate,up,down}_proj.weight` (DeepSeek
    releases) and the fused `<p>.mlp.experts.gate_up_proj` [E, 2I, H] / `<p>.mlp.experts.down_proj`
    [E, H, I] (HF's in-memory layout), each optionally with a `..._scale_inv` block-scale twin.
    Tracks every (expert, gate|up|down) slice so a slice loaded twice, or never, is an error
    naming it. Use `load_layer_weight` as load_params_strict's `custom` hook, then `finish`.
    """

    def __init__(self) -> None:
        self._filled: dict[str, set[tuple[int, str]]] = {}

    def load_layer_weight(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> bool:
        """Copy one expert checkpoint tensor (already renamed to the model's prefix); False when
        name is not an expert weight or names no stacked parameter (the caller then decides)."""
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            return False
        prefix, fused = m["prefix"], m["fused"]
        proj = fused or m["proj"]
        scale = bool(m["scale"] or m["fused_scale"])
        stack = "w2_weight" if proj == "down_proj" else "w13_weight"
        param_name = f"{prefix}.{stack}{'_scale_inv' if scale else ''}"
        param = params.get(param_name)
        if param is None:
            return False
        num_experts = param.shape[0]
        # Scales of w13 stack the gate's grid over the up projection's, as weights stack rows.
        half = param.shape[1] // 2
        parts = _EXPERT_PARTS[proj]
        if fused:
            experts = list(range(num_experts))
            dst = param.data
        else:
            e = int(m["expert"])
            if e >= num_experts:
                raise WeightLoadError(
                    f"checkpoint weight {name!r} names expert {e} but {param_name!r} holds "
                    f"{num_experts} experts"
                )
            experts = [e]
            dst = param.data[e]
            if proj == "gate_proj":
                dst = dst[:half]
            elif proj == "up_proj":
                dst = dst[half:]
        if tuple(tensor.shape) != tuple(dst.shape):
            what = "block scale" if scale else "weight"
            raise WeightLoadError(
                f"{what} {name!r} has shape {tuple(tensor.shape)} in the checkpoint but the "
                f"model expects {tuple(dst.shape)} (a slice of {param_name!r})"
            )
        filled = self._filled.setdefault(param_name, set())
        slices = {(e, p) for e in experts for p in parts}
        twice = slices & filled
        if twice:
            e, p = min(twice)
            raise WeightLoadError(
                f"expert weight {prefix}.{e}.{p}_proj.weight{'_scale_inv' if scale else ''} is "
                f"loaded twice (again by {name!r})"
            )
        with torch.no_grad():
            if scale or dst.dtype == FP8_DTYPE:
                load_fp8_tensor(dst, tensor, name)
            else:
                reject_quantized_tensor(name, tensor, param_name)
                dst.copy_(tensor.to(dst.dtype))
        filled |= slices
        return True

    def finish(self, model: nn.Module, loaded: set[str]) -> None:
        """Raise naming every expert slice of this stage never loaded (an FP8 slice without its
        scale by both names); mark full stacks loaded."""
        missing: list[str] = []
        for param_name, param in model.named_parameters():
            prefix, _, leaf = param_name.rpartition(".")
            if not prefix.endswith(".mlp.experts") or leaf not in _EXPERT_STACKS:
                continue
            if is_pp_missing_parameter(param_name, model):
                continue
            parts = ("down",) if leaf.startswith("w2_") else ("gate", "up")
            suffix = "_scale_inv" if leaf.endswith("_scale_inv") else ""
            filled = self._filled.get(param_name, set())
            absent = [
                f"{prefix}.{e}.{p}_proj.weight{suffix}"
                for e in range(param.shape[0])
                for p in parts
                if (e, p) not in filled
            ]
            if absent:
                missing += absent
            else:
                loaded.add(param_name)
        if not missing:
            return
        lone = [
            n
            for n in missing
            if n.endswith("_scale_inv") and n[: -len("_scale_inv")] not in missing
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
            f"checkpoint is missing expert weight(s) for {type(model).__name__}: "
            f"{missing[:8]}{more}"
        )


class DeepseekV2Model(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str = "model",
        layer_fn: Callable[[str], nn.Module] | None = None,
    ) -> None:
        """layer_fn(prefix) builds one decoder layer (default: DeepseekV2DecoderLayer)."""
        super().__init__()
        self.config = config
        init_pp_decoder(
            self,
            config,
            layer_fn or (lambda p: DeepseekV2DecoderLayer(config, p)),
            lambda: RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)),
            prefix,
            embed_on_last=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate_tensors is not None:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        else:
            hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        for i in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[i](positions, hidden, residual)
        if get_pp_group().is_last_rank:
            return self.norm(hidden, residual)[0]
        return IntermediateTensors({"hidden_states": hidden, "residual": residual})


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 causal LM (MLA + MoE); supports pipeline parallelism."""

    supports_pp = True

    def __init__(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> None:
        super().__init__()
        config = model_config.hf_text_config
        self.config = config
        self.model = self._init_model(vllm_config, config, maybe_prefix(prefix, "model"))
        if spec_decode_needs_target_embed(vllm_config) and isinstance(
            self.model.embed_tokens, PPMissingLayer
        ):
            # An EAGLE draft on this (last) stage shares the target's table; the loader fills it.
            self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if get_pp_group().is_last_rank:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if self.tied:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def _init_model(self, vllm_config: VllmConfig, config: Any, prefix: str) -> nn.Module:
        """The inner decoder; subclasses with a different decoder (V3.2) override this."""
        return DeepseekV2Model(config, prefix=prefix)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if get_spec_layer_idx_from_weight_name(self.config, name) is not None:
                return None  # MTP layers: loaded by the MTP drafter
            if self.tied and name == "lm_head.weight":
                return None  # tied checkpoints may still carry a copy
            return name

        experts = ExpertWeightLoader()
        loaded = load_params_strict(self, weights, rename, custom=experts.load_layer_weight)
        experts.finish(self, loaded)
        shared = {"lm_head.weight"} if self.tied else set()
        check_all_loaded(self, loaded, shared)
        params = dict(self.named_parameters(remove_duplicate=False))
        return {n for n in loaded if n in params}


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 causal LM: sigmoid routing with e_score_correction_bias (from the config)."""
