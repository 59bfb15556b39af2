# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Block-quantized FP8 weights as DeepSeek (V3, R1, V3.2), GLM-5 and Qwen3.5 publish them:
float8_e4m3fn weights with one `weight_scale_inv` per [bn, bk] block (real = fp8 * scale_inv;
a ceil-divided grid, so edge blocks may be partial), `quantization_config` =
{quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic", weight_block_size: [bn, bk]}.

Compute: with an FP8 block GEMM on the device (CUDA, see fp8_kernels) the weights stay FP8 and
activations are quantized per token and K-block on the fly. Elsewhere the weights are
dequantized to the compute dtype, either once after loading (the CPU default: it decodes as fast
as the unquantized model) or per forward (FP8 stays resident: half the memory of bf16, slower);
VLLM_FP8_DEQUANT=load|forward overrides the choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm import envs
from vllm.config.quantization import Fp8Config
from vllm.forward_context import RowKinds
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import (
    ExpertLinear,
    FusedMoE,
    UnquantizedFusedMoEMethod,
    fused_moe,
)
from vllm.model_executor.layers.linear import (
    LinearLayerBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization.fp8_kernels import block_grid, dequantize_fp8_block
from vllm.model_executor.model_loader.weight_utils import FP8_DTYPES, WeightLoadError

logger = init_logger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# What block scales may be stored as (Qwen's FP8 releases use bfloat16); converted to float32.
_SCALE_DTYPES = frozenset(
    [torch.float32, torch.bfloat16, torch.float16]
    + ([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])
)


def _dense_mode(device: torch.device) -> str:
    """'load' or 'forward': how a layer without an FP8 GEMM gets its dense weight."""
    mode = envs.VLLM_FP8_DEQUANT
    if mode != "auto":
        return mode
    # Measured on CPU (benchmarks/fp8.py): dequantizing per forward decodes several times
    # slower than the dense model; on GPUs memory is the scarcer resource.
    return "load" if device.type == "cpu" else "forward"


def _use_fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and envs.VLLM_FP8_DEQUANT == "auto"


def _check_fp8_tensor(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != FP8_DTYPE:
        raise WeightLoadError(
            f"checkpoint weight {name!r} is stored as {tensor.dtype}, but the fp8 "
            f"quantization_config (fmt e4m3) needs {FP8_DTYPE}"
        )


def _load_scale(dst: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _SCALE_DTYPES:
        raise WeightLoadError(
            f"scale {name!r} is stored as {tensor.dtype}; block scales must be floating point "
            "(float32, bfloat16, float16 or float8_e8m0fnu)"
        )
    dst.copy_(tensor.to(torch.float32))


def load_fp8_tensor(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` into FP8 weight storage (it must be FP8 e4m3) or into
    float32 block-scale storage (it must be a float scale)."""
    if dst.dtype == FP8_DTYPE:
        _check_fp8_tensor(name, tensor)
        dst.copy_(tensor)
    else:
        _load_scale(dst, name, tensor)


class Fp8Methods:
    """Block FP8's layer methods (the QuantMethods a model is built under)."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def linear(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.config)

    def moe(self) -> Fp8MoEMethod:
        return Fp8MoEMethod(self.config)


class Fp8LinearMethod(LinearMethodBase):
    """An FP8 weight [out, in] plus its float32 `weight_scale_inv` grid. A checkpoint that
    stores this layer unquantized (modules_to_not_convert, or a publisher's choice, e.g. an MTP
    projection) loads as stored and the layer becomes unquantized."""

    def __init__(self, config: Fp8Config) -> None:
        self.block = config.weight_block_size

    def create_weights(
        self, layer: LinearLayerBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False
        )
        layer.weight_scale_inv = nn.Parameter(
            torch.empty(block_grid(output_size, input_size, self.block), dtype=torch.float32),
            requires_grad=False,
        )
        layer.weight_block_size = self.block
        layer.fp8_stored = None  # True / False once the checkpoint's weight was seen
        layer.fp8_gemm_scale = None  # the scale laid out for the FP8 GEMM, when one is used

    def load_weight(
        self, layer: LinearLayerBase, leaf: str, tensor: torch.Tensor, name: str
    ) -> bool:
        shape = (layer.out_features, layer.in_features)
        if leaf == "weight":
            if tuple(tensor.shape) != shape:
                raise WeightLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
                    f"the model expects {shape}"
                )
            if tensor.is_floating_point() and tensor.dtype not in FP8_DTYPES:
                # Stored unquantized: keep it as it is (in the compute dtype).
                layer.weight = nn.Parameter(
                    tensor.to(device=layer.weight.device, dtype=layer.params_dtype),
                    requires_grad=False,
                )
                layer.fp8_stored = False
                return True
            load_fp8_tensor(layer.weight.data, tensor, name)
            layer.fp8_stored = True
            return True
        if leaf == "weight_scale_inv":
            grid = block_grid(*shape, self.block)
            if tuple(tensor.shape) != grid:
                weight_name = name[: -len("_scale_inv")]
                raise WeightLoadError(
                    f"scale {name!r} has shape {tuple(tensor.shape)} but weight {weight_name!r} "
                    f"{shape} in weight_block_size {list(self.block)} blocks needs {grid}"
                )
            load_fp8_tensor(layer.weight_scale_inv.data, tensor, name)
            return True
        return False

    def finish_loading(self, layer: LinearLayerBase, prefix: str, loaded: set[str]) -> None:
        weight, scale = f"{prefix}.weight", f"{prefix}.weight_scale_inv"
        if layer.fp8_stored is True and scale not in loaded:
            raise WeightLoadError(
                f"checkpoint weight {weight!r} is FP8 but its block scale {scale!r} is missing"
            )
        if layer.fp8_stored is False:
            if scale in loaded:
                raise WeightLoadError(
                    f"checkpoint has the block scale {scale!r}, but weight {weight!r} is stored "
                    f"unquantized ({layer.weight.dtype})"
                )
            del layer.weight_scale_inv
            layer.quant_method = UnquantizedLinearMethod()

    def process_weights_after_loading(self, layer: LinearLayerBase) -> None:
        device = layer.weight.device
        if _use_fp8_gemm(device):
            from vllm.model_executor.layers.quantization import fp8_kernels

            layer.fp8_gemm_scale = fp8_kernels.prepare_block_fp8_gemm(
                layer.weight, layer.weight_scale_inv, self.block, layer.params_dtype
            )
            if layer.fp8_gemm_scale is not None:
                return
        if _dense_mode(device) == "load":
            self.dequantize_(layer)

    def dequantize_(self, layer: LinearLayerBase) -> None:
        dense = dequantize_fp8_block(
            layer.weight, layer.weight_scale_inv, self.block, layer.params_dtype
        )
        layer.weight = nn.Parameter(dense, requires_grad=False)
        del layer.weight_scale_inv
        layer.fp8_gemm_scale = None
        layer.quant_method = UnquantizedLinearMethod()

    def apply(
        self,
        layer: LinearLayerBase,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        rows: RowKinds | None,
    ) -> torch.Tensor:
        # The FP8 GEMM and the dequantized product have no small-M route: rows go unused.
        if layer.fp8_gemm_scale is not None:
            from vllm.model_executor.layers.quantization import fp8_kernels

            return fp8_kernels.block_fp8_linear(x, layer.weight, layer.fp8_gemm_scale, bias)
        w = dequantize_fp8_block(layer.weight, layer.weight_scale_inv, self.block, x.dtype)
        return F.linear(x, w, bias)


class Fp8MoEMethod:
    """Stacked FP8 experts: w13_weight [E, 2I, H] (gate rows, then up rows) and w2_weight
    [E, H, I], with w13_weight_scale_inv [E, 2 * ceil(I/bn), ceil(H/bk)] (the gate's grid, then
    the up projection's: each keeps its own edge blocks) and w2_weight_scale_inv
    [E, ceil(H/bn), ceil(I/bk)]. Experts are loaded strictly: every slice FP8 with its scale."""

    def __init__(self, config: Fp8Config) -> None:
        self.block = config.weight_block_size

    def create_weights(
        self,
        layer: FusedMoE,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size
        gi, gh = block_grid(i, h, self.block)
        gh2, gi2 = block_grid(h, i, self.block)

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.w13_weight = param(e, 2 * i, h, dtype=FP8_DTYPE)
        layer.w2_weight = param(e, h, i, dtype=FP8_DTYPE)
        layer.w13_weight_scale_inv = param(e, 2 * gi, gh, dtype=torch.float32)
        layer.w2_weight_scale_inv = param(e, gh2, gi2, dtype=torch.float32)
        layer.params_dtype = params_dtype
        layer.fp8_gemm_scales = None

    def load_expert_weight(
        self, dst: torch.Tensor, tensor: torch.Tensor, ckpt_name: str, param_name: str
    ) -> None:
        """An FP8 slice of a stacked weight, or a float slice of its block scales."""
        load_fp8_tensor(dst, tensor, ckpt_name)

    def _dense_w13(self, w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize w13 rows [..., 2I, H]: gate and up each against their own grid."""
        i = w.shape[-2] // 2
        gi = s.shape[-2] // 2
        gate = dequantize_fp8_block(w[..., :i, :], s[..., :gi, :], self.block, dtype)
        up = dequantize_fp8_block(w[..., i:, :], s[..., gi:, :], self.block, dtype)
        return torch.cat([gate, up], dim=-2)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        device = layer.w13_weight.device
        if _use_fp8_gemm(device):
            from vllm.model_executor.layers.quantization import fp8_kernels

            scales = fp8_kernels.prepare_moe_block_fp8_gemm(layer, self.block)
            if scales is not None:
                layer.fp8_gemm_scales = scales
                return
        if _dense_mode(device) == "load":
            dtype = layer.params_dtype
            w13 = torch.empty(layer.w13_weight.shape, dtype=dtype, device=device)
            w2 = torch.empty(layer.w2_weight.shape, dtype=dtype, device=device)
            # One expert at a time: a whole stack's float32 temporary would be the size of the
            # layer (tens of GB for DeepSeek-V3's 256 experts).
            for e in range(w13.shape[0]):
                w13[e] = self._dense_w13(layer.w13_weight[e], layer.w13_weight_scale_inv[e], dtype)
                w2[e] = dequantize_fp8_block(
                    layer.w2_weight[e], layer.w2_weight_scale_inv[e], self.block, dtype
                )
            layer.w13_weight = nn.Parameter(w13, requires_grad=False)
            layer.w2_weight = nn.Parameter(w2, requires_grad=False)
            del layer.w13_weight_scale_inv, layer.w2_weight_scale_inv
            layer.quant_method = UnquantizedFusedMoEMethod()

    def _expert_linear(self, layer: FusedMoE) -> ExpertLinear:
        if layer.fp8_gemm_scales is not None:
            from vllm.model_executor.layers.quantization import fp8_kernels

            return fp8_kernels.moe_expert_linear(layer)

        def linear(x: torch.Tensor, expert: int, proj: str, rows: RowKinds | None) -> torch.Tensor:
            if proj == "w13":
                w = self._dense_w13(
                    layer.w13_weight[expert], layer.w13_weight_scale_inv[expert], x.dtype
                )
            else:
                w = dequantize_fp8_block(
                    layer.w2_weight[expert], layer.w2_weight_scale_inv[expert], self.block, x.dtype
                )
            return F.linear(x, w)

        return linear

    def apply(
        self,
        layer: FusedMoE,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        rows: RowKinds | None,
    ) -> torch.Tensor:
        return fused_moe(
            hidden_states,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            rows,
            expert_linear=self._expert_linear(layer),
        )
