# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""A worker's adapters: which request runs which adapter, the device slots (least recently
used evicted, up to max_loras) and the host copies (up to max_cpu_loras), and per step each
row's slot, handed to the stage's LoRA layers. Each stage loads only its own layers' parts,
each TP rank only its split of them; the draft model is never touched."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from vllm.config.lora import LoRAConfig
from vllm.lora.layers import LoRABatch, LoRALayer
from vllm.lora.peft import load_adapter
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.linear import LinearLayerBase
from vllm.model_executor.models.utils import is_pp_missing_parameter, stacked_params_mapping
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu.features import RunnerFeature, StepInputs

# An adapter on one stage: engine layer name -> {sub-projection (None: whole layer): (A, B)}.
StageParts = dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]]


class LoRAWorkerManager(RunnerFeature):
    """A runner feature: before each forward, every LoRA layer learns each row's slot."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.modules = dict(model.named_modules())
        self.stacked = stacked_params_mapping(self.modules)
        self.layers: dict[str, LoRALayer] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, LRU first
        self.host: OrderedDict[str, StageParts] = OrderedDict()
        self.req_lora: dict[str, LoRARequest] = {}
        self.num_loads = 0  # adapters copied into a device slot (evictions show here)

    def prepare_step(self, step: StepInputs) -> None:
        self.start_step(step.so, step.batch.num_tokens_after_padding)

    def start_step(self, so: SchedulerOutput, num_rows: int) -> None:
        """Track this step's requests and give every LoRA layer each row's slot."""
        for rid in so.finished_req_ids:
            self.req_lora.pop(rid, None)
        for d in so.scheduled_new_reqs:
            if d.lora_request is not None:
                self.req_lora[d.req_id] = d.lora_request
        lrs = [self.req_lora.get(rid) for rid in so.num_scheduled_tokens]
        active = {lr.cache_key for lr in lrs if lr is not None}
        if len(active) > self.config.max_loras:
            raise RuntimeError(
                f"a step uses {len(active)} adapters, above max_loras={self.config.max_loras}"
            )
        slots = [-1 if lr is None else self._activate(lr, active) for lr in lrs]
        counts = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(slots))
        row_slots = np.full(num_rows, -1, dtype=np.int64)
        row_slots[: int(counts.sum())] = np.repeat(np.array(slots, dtype=np.int64), counts)
        batch = LoRABatch(row_slots, self.config.max_lora_rank, self._device(), self.dtype)
        for layer in self.layers.values():
            layer.batch = batch

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _activate(self, lr: LoRARequest, active: set[str]) -> int:
        """The adapter's device slot, loading it (evicting the least recently used adapter
        that this step does not use) when it is not resident."""
        aid = lr.cache_key
        if aid in self.slot_of:
            self.slot_of.move_to_end(aid)
            return self.slot_of[aid]
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in active)
            slot = self.slot_of.pop(victim)
        parts = self._host_parts(lr)
        for name, layer in self.layers.items():
            layer.set_slot(slot, parts.get(name, {}))
        for name in parts.keys() - self.layers.keys():
            self.layers[name] = self._new_layer(name)
            self.layers[name].set_slot(slot, parts[name])
        self.slot_of[aid] = slot
        self.num_loads += 1
        return slot

    def _new_layer(self, name: str) -> LoRALayer:
        module = self.modules[name]
        assert isinstance(module, LinearLayerBase)
        return LoRALayer(module, self.config.max_loras, self.config.max_lora_rank, self.dtype)

    def _host_parts(self, lr: LoRARequest) -> StageParts:
        aid = lr.cache_key
        if aid in self.host:
            self.host.move_to_end(aid)
            return self.host[aid]
        adapter = load_adapter(lr.lora_path, self.config.max_lora_rank)
        parts: StageParts = {}
        for module_path, (a, b) in adapter.weights.items():
            target = self._target(module_path)
            if target is None:
                continue
            name, shard = target
            layer = self.layers.get(name) or self._probe(name)
            a, b = layer.part_of(shard, a, b)
            b = b * adapter.config.scaling(module_path)
            parts.setdefault(name, {})[shard] = (a.to(self.dtype), b.to(self.dtype))
        self.host[aid] = parts
        assert self.config.max_cpu_loras is not None
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return parts

    def _probe(self, name: str) -> LoRALayer:
        layer = self._new_layer(name)
        self.layers[name] = layer
        return layer

    def _target(self, module_path: str) -> tuple[str, int | None] | None:
        """(engine layer, sub-projection) of an HF module path; None when this stage does
        not hold it (another pipeline stage, or weights the target skips such as MTP)."""
        name = self.model.checkpoint_to_param_name(f"{module_path}.weight")  # type: ignore[operator]
        if name is None or is_pp_missing_parameter(name, self.model):
            return None
        owner = name.rpartition(".")[0]
        if owner in self.stacked:
            return self.stacked[owner]
        if isinstance(self.modules.get(owner), LinearLayerBase):
            return owner, None
        raise ValueError(f"LoRA target {module_path}: the model has no linear layer {owner}")
