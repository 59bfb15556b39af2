# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Linear layers whose weight storage and matmul belong to a method object (unquantized, or a
quantization method such as block FP8), chosen from the model's build context; their tensor-
parallel variants. Every layer's forward takes the rows' kinds as a required argument
(`layer(x, ctx.rows)`); the product itself (routing rows by those kinds to the small-M kernel or
BLAS) is gemm.py's."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from vllm.forward_context import RowKinds
from vllm.model_executor.build_context import current_build_context
from vllm.model_executor.layers.gemm import linear


class RoutedLinear(nn.Linear):
    """nn.Linear (never quantized: a quantized checkpoint tensor reaching it is a load error)
    whose product runs through linear(): decode / verify / draft rows on the CPU small-M
    kernel. For LM heads, draft heads and the drafts' fc layers."""

    # Unlike nn.Linear's, forward requires the rows' kinds (forgetting them is a TypeError).
    def forward(self, x: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:  # type: ignore[override]
        return linear(x, self.weight, self.bias, rows)


class LinearLayerBase(nn.Module):
    """The attributes a linear layer shares with its method object: the method creates and
    replaces the parameters from outside the layer, so they are declared here for both."""

    in_features: int
    out_features: int
    params_dtype: torch.dtype
    quant_method: LinearMethodBase
    weight: nn.Parameter
    bias: nn.Parameter | None
    # Set by block-FP8 (Fp8LinearMethod) only.
    weight_scale_inv: nn.Parameter
    weight_block_size: tuple[int, int]
    fp8_stored: bool | None
    fp8_gemm_scale: torch.Tensor | None


class LinearMethodBase:
    """How a linear layer stores its weight and computes x @ W^T (+ bias)."""

    def create_weights(
        self, layer: LinearLayerBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        raise NotImplementedError

    def apply(
        self,
        layer: LinearLayerBase,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        rows: RowKinds | None,
    ) -> torch.Tensor:
        """rows: the kinds of x's rows (gemm.linear); a method whose product has no small-M
        route ignores them."""
        raise NotImplementedError

    def load_weight(
        self, layer: LinearLayerBase, leaf: str, tensor: torch.Tensor, name: str
    ) -> bool:
        """Copy checkpoint tensor `name` into the layer's parameter `leaf`; False leaves it to
        the default loader (a plain copy with a shape check)."""
        return False

    def finish_loading(self, layer: LinearLayerBase, prefix: str, loaded: set[str]) -> None:
        """After the checkpoint was read: raise naming what is inconsistent (e.g. a quantized
        weight without its scale) and drop parameters the checkpoint did not need."""

    def process_weights_after_loading(self, layer: LinearLayerBase) -> None:
        """Convert the loaded weights into the form apply() computes with."""

    def dequantize_(self, layer: LinearLayerBase) -> None:
        """Turn the layer into a plain unquantized one (no-op when it already is)."""


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(
        self, layer: LinearLayerBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False
        )

    def apply(
        self,
        layer: LinearLayerBase,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        rows: RowKinds | None,
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias, rows)


def _create_linear_weights(layer: LinearLayerBase, method: LinearMethodBase, bias: bool) -> None:
    """Give layer (with in_features, out_features, params_dtype) its quant_method, the
    method's weights and an optional bias."""
    layer.quant_method = method
    method.create_weights(layer, layer.in_features, layer.out_features, layer.params_dtype)
    if bias:
        layer.bias = nn.Parameter(
            torch.empty(layer.out_features, dtype=layer.params_dtype), requires_grad=False
        )
    else:
        layer.register_parameter("bias", None)


class ReplicatedLinear(LinearLayerBase):
    """y = x @ W^T + b with W [output_size, input_size], stored and multiplied as the quant
    config of the model being built says (unquantized without one). Every rank holds all of W.

    Exposes nn.Linear's in_features / out_features / bias. Layers that must never be quantized
    (router gates, lm_head) stay nn.Linear, so a quantized checkpoint tensor reaching them is a
    load error instead of a silent cast.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = int(input_size)
        self.out_features = int(output_size)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        methods = current_build_context().quant_methods
        method = methods.linear() if methods is not None else UnquantizedLinearMethod()
        _create_linear_weights(self, method, bias)

    def forward(self, x: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias, rows)

    def extra_repr(self) -> str:
        method = type(self.quant_method).__name__
        return f"in_features={self.in_features}, out_features={self.out_features}, {method}"


def dequantize_linear_(layer: nn.Module) -> None:
    """Store a (possibly quantized) linear layer's weight unquantized from now on: consumers
    that transform the weight itself (MLA absorbing kv_b_proj) need it in the compute dtype."""
    method = getattr(layer, "quant_method", None)
    if method is not None:
        method.dequantize_(layer)


class MergedReplicatedLinear(LinearLayerBase):
    """Several projections of one input packed into one: y = x @ [W_0; W_1; ...]^T, shard i
    being output columns [offset_i, offset_i + output_sizes[i]) (vLLM's qkv_proj /
    gate_up_proj). One larger GEMM instead of several, and no concatenation of their outputs.

    The checkpoint keeps the projections apart (shard_names, e.g. q_proj / k_proj / v_proj next
    to this layer): the loader maps each to its rows (stacked_params_mapping). Unquantized, the
    layer holds one `weight` [sum(output_sizes), input_size] (and `bias`). With a quantization
    config, every shard is a ReplicatedLinear of its own under `shards` (each with its own
    scale grid, whose edge blocks do not line up with a packed matrix's); when loading leaves
    them all unquantized (FP8 dequantized at load on CPU), they are packed into one weight.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        shard_names: tuple[str, ...],
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if len(output_sizes) != len(shard_names) or not output_sizes:
            raise ValueError(
                f"need one shard name per output size, got {shard_names} for {output_sizes}"
            )
        self.in_features = int(input_size)
        self.output_sizes = [int(n) for n in output_sizes]
        self.out_features = sum(self.output_sizes)
        self.shard_names = tuple(shard_names)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.shards: nn.ModuleList | None = None
        if current_build_context().quant_methods is None:
            _create_linear_weights(self, UnquantizedLinearMethod(), bias)
        else:
            self.shards = nn.ModuleList(
                ReplicatedLinear(input_size, n, bias=bias, params_dtype=params_dtype)
                for n in self.output_sizes
            )

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first output row, number of rows) of shard `shard` in the packed weight."""
        return self.offsets[shard], self.output_sizes[shard]

    def forward(self, x: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:
        if self.shards is None:
            return linear(x, self.weight, self.bias, rows)
        return torch.cat([s(x, rows) for s in self.shards], dim=-1)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The packed output's per-shard parts (views)."""
        return y.split(self.output_sizes, dim=-1)

    def process_weights_after_loading(self) -> None:
        # Runs after every layer's quant method converted its weights.
        if self.shards is None or not all(
            isinstance(s.quant_method, UnquantizedLinearMethod) for s in self.shards
        ):
            return
        # nn.ModuleList is untyped: its entries are the ReplicatedLinear shards built above.
        shards = cast("list[ReplicatedLinear]", list(self.shards))
        weight = torch.cat([s.weight for s in shards], dim=0)
        bias: torch.Tensor | None = None
        if shards[0].bias is not None:
            bias = torch.cat([cast(torch.Tensor, s.bias) for s in shards])
        self.params_dtype = weight.dtype
        del self.shards
        self.shards = None
        self.quant_method = UnquantizedLinearMethod()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        packed = "packed" if self.shards is None else "per-shard"
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, "
            f"shards={self.shard_names}, {packed}"
        )


# ---- tensor parallelism -----------------------------------------------------------------------
# The TP layers keep their sharding in construction (local sizes) and in weight loading
# (tp_shard_checkpoint_tensor: the rank's rows / columns of a checkpoint tensor); the matmul is
# the replicated layer's, and the all-reduce follows it (RowParallelLinear).


def _tp() -> tuple[int, int]:
    tp = current_build_context().tp
    return tp.rank, tp.world_size


def divide(n: int, parts: int, what: str) -> int:
    """n / parts, refusing a split that does not divide (naming what is split)."""
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({parts})")
    return n // parts


class TPSharded:
    """A layer that holds one TP rank's part of its checkpoint tensors: the loader hands it
    each whole tensor and copies what tp_shard_checkpoint_tensor returns (a view)."""

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def shard_packed_rows(
    tensor: torch.Tensor, sizes: list[int], rank: int, tp_size: int, dim: int = 0
) -> torch.Tensor:
    """Rank `rank`'s part of each of the segments `sizes` (whole sizes along dim, in order)
    of a checkpoint tensor that packs them, concatenated; a tensor of another size along dim
    is returned as is (the loader's shape check names it)."""
    if tp_size == 1 or tensor.dim() <= dim or tensor.shape[dim] != sum(sizes):
        return tensor
    parts, start = [], 0
    for n in sizes:
        k = n // tp_size
        parts.append(tensor.narrow(dim, start + rank * k, k))
        start += n
    return torch.cat(parts, dim=dim)


def shard_block_scale(
    tensor: torch.Tensor, dim: int, index: int, size: int, block: int, what: str
) -> torch.Tensor:
    """Part `index` of a block-scale grid whose weight is split in parts of `size` along dim
    (each part must start on a block boundary, so size must be a multiple of the block)."""
    if size % block:
        raise ValueError(
            f"{what}: a tensor_parallel_size split gives each rank {size} rows / columns, not a "
            f"multiple of the checkpoint's weight_block_size ({block}); use a smaller "
            "tensor_parallel_size"
        )
    n = size // block
    if tensor.dim() <= dim or tensor.shape[dim] < (index + 1) * n:
        return tensor
    return tensor.narrow(dim, index * n, n)


def _narrow_rows(tensor: torch.Tensor, dim: int, index: int, size: int, name: str) -> torch.Tensor:
    """Part `index` (of `size` along dim) of a checkpoint tensor, as a view; a tensor too
    small for it is left as is (the loader's shape check names it)."""
    if tensor.dim() <= dim or tensor.shape[dim] < (index + 1) * size:
        return tensor
    return tensor.narrow(dim, index * size, size)


class ColumnParallelLinear(ReplicatedLinear, TPSharded):
    """y = x @ W^T + b with W's output rows split over the TP ranks: rank r holds rows
    [r * out / TP, (r + 1) * out / TP) of W and b, and computes that slice of y (gathered
    over the ranks only with gather_output). packed_sizes: the checkpoint's one tensor packs
    several projections (e.g. Gated DeltaNet's q, k, v) of these sizes: each is split on its
    own, so rank r holds its part of each, in order."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        gather_output: bool = False,
        packed_sizes: list[int] | None = None,
    ) -> None:
        self.tp = current_build_context().tp
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.world_size
        self.packed_sizes = packed_sizes
        for n in packed_sizes or [output_size]:
            divide(int(n), self.tp_size, "output_size")
        self.output_size_per_partition = divide(int(output_size), self.tp_size, "output_size")
        super().__init__(input_size, self.output_size_per_partition, bias, params_dtype)
        self.gather_output = gather_output

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        n = self.output_size_per_partition
        if leaf == "weight_scale_inv":
            if self.tp_size == 1:
                return tensor
            bn = self.weight_block_size[0]
            if self.packed_sizes is not None:
                for size in self.packed_sizes:
                    shard_block_scale(tensor, 0, 0, size // self.tp_size, bn, "weight_scale_inv")
                units = [size // bn for size in self.packed_sizes]
                return shard_packed_rows(tensor, units, self.tp_rank, self.tp_size)
            return shard_block_scale(tensor, 0, self.tp_rank, n, bn, "weight_scale_inv")
        if self.packed_sizes is not None:
            return shard_packed_rows(tensor, self.packed_sizes, self.tp_rank, self.tp_size)
        return _narrow_rows(tensor, 0, self.tp_rank, n, leaf)

    def forward(self, x: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:
        y = super().forward(x, rows)
        if self.gather_output and self.tp_size > 1:
            y = self.tp.all_gather(y, dim=-1)
        return y


class RowParallelLinear(ReplicatedLinear, TPSharded):
    """y = x @ W^T + b with W's input columns split over the TP ranks: rank r holds columns
    [r * in / TP, (r + 1) * in / TP) (its slice of x comes from a column-parallel layer),
    computes a partial product, and the ranks' products are summed (all-reduce); the bias,
    held whole by every rank, is added once after the sum."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        self.tp = current_build_context().tp
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.world_size
        self.input_size_per_partition = divide(int(input_size), self.tp_size, "input_size")
        super().__init__(self.input_size_per_partition, output_size, bias, params_dtype)
        self.reduce_results = reduce_results

    def tp_shard_checkpoint_tensor(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        k = self.input_size_per_partition
        if leaf == "weight_scale_inv" and self.tp_size > 1:
            bk = self.weight_block_size[1]
            return shard_block_scale(tensor, 1, self.tp_rank, k, bk, "weight_scale_inv")
        if leaf != "weight":
            return tensor  # the bias is whole on every rank
        return _narrow_rows(tensor, 1, self.tp_rank, k, leaf)

    def forward(self, x: torch.Tensor, rows: RowKinds | None) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x, rows)
        y = self.quant_method.apply(self, x, None, rows)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class MergedColumnParallelLinear(MergedReplicatedLinear):
    """A packed projection (gate_up_proj, qkv_proj) whose every sub-matrix is split over the
    TP ranks on its own: rank r packs its slice of each (vLLM's MergedColumnParallelLinear).
    output_sizes are the whole sub-matrices' rows; replicas[i] > 1 says sub-matrix i has fewer
    parts than ranks and each part is held by that many consecutive ranks (KV heads fewer
    than TP)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        shard_names: tuple[str, ...],
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        replicas: list[int] | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = _tp()
        replicas = replicas or [1] * len(output_sizes)
        local = [
            divide(int(n), self.tp_size // r, f"output_size of {name}")
            for n, r, name in zip(output_sizes, replicas, shard_names)
        ]
        self.replicas = list(replicas)
        super().__init__(input_size, local, shard_names, bias, params_dtype)

    def tp_shard_checkpoint_tensor(
        self, shard: int, tensor: torch.Tensor, leaf: str = "weight"
    ) -> torch.Tensor:
        """This rank's rows of sub-matrix `shard` (a whole checkpoint tensor), or of its block
        scales (leaf weight_scale_inv: the shard is a quantized layer of its own)."""
        part = self.tp_rank // self.replicas[shard]
        rows = self.output_sizes[shard]
        if leaf == "weight_scale_inv":
            if self.tp_size == 1 or self.shards is None:
                return tensor
            sub = cast("ReplicatedLinear", self.shards[shard])
            bn = sub.weight_block_size[0]
            return shard_block_scale(tensor, 0, part, rows, bn, "weight_scale_inv")
        return _narrow_rows(tensor, 0, part, rows, self.shard_names[shard])


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v packed, split by heads: each rank holds num_heads / TP query heads and
    num_kv_heads / TP KV heads, or, with fewer KV heads than ranks, one KV head shared by
    TP / num_kv_heads consecutive ranks."""

    def __init__(
        self,
        input_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        v_head_size: int | None = None,
        q_head_size: int | None = None,
    ) -> None:
        """q_head_size: rows per query head in q_proj (default head_size; Qwen3.5 packs each
        head's output gate next to its query: twice that)."""
        _, tp = _tp()
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            kv_replicas = 1
        else:
            if tp % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) is not a multiple of num_key_value_heads "
                    f"({total_num_kv_heads}), which is smaller"
                )
            self.num_kv_heads = 1
            kv_replicas = tp // total_num_kv_heads
        v = v_head_size or head_size
        q = q_head_size or head_size
        super().__init__(
            input_size,
            [total_num_heads * q, total_num_kv_heads * head_size, total_num_kv_heads * v],
            ("q_proj", "k_proj", "v_proj"),
            bias=bias,
            params_dtype=params_dtype,
            replicas=[1, kv_replicas, kv_replicas],
        )
