# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The model runner's features as plug-ins: what multimodal inputs, LoRA adapters, a hybrid
model's linear-attention states, structured outputs, the logit controls and pipeline
parallelism add to a step, each behind the same few hooks.

A ModelRunner builds the list of its active features once (when its model is loaded) and, at
each point of a step, calls the features that implement that point's hook, in the list's
order (RunnerFeatures.ORDER). A step, with the hooks where they run:

    begin_step        before anything: PP applies the last stage's earlier results
    remove_request    each finished request, right after its request state is freed
    add_requests      the step's new requests (every step, maybe none), right after they got
                      request-state slots
    prepare_step      before the forward: may replace positions, set inputs_embeds and the
                      linear-attention metadata, set per-row adapter slots
    -- forward --
    adjust_logits     last stage, before sampling: grammar bitmasks, then the logit controls
    after_accept      last stage, once the step's tokens are known, before drafting
    after_step        after the step's result is applied (last stage) or the forward (others):
                      PP broadcasts / receives the result, multimodal frees what is computed
    bytes / allocate  memory the feature takes from the KV budget, allocated with the KV cache

Every hook of the base class does nothing; a feature overrides the ones it needs, and only
those are called. This module imports nothing at run time (a leaf), so any layer may
implement a feature."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.states import RequestStates, StepResult


@dataclass
class StepInputs:
    """A step's forward inputs while the features prepare them."""

    so: SchedulerOutput
    batch: InputBatch
    states: RequestStates
    positions: torch.Tensor  # [T], or [3, T] once M-RoPE positions replace them
    inputs_embeds: torch.Tensor | None = None  # set: the forward reads these, not the ids
    linear_attn_metadata: Any = None  # hybrid models: the step's GDN metadata


@dataclass
class LogitRows:
    """What each logits row of a step is (the last stage, before sampling)."""

    states: RequestStates
    slots: np.ndarray  # [N] the request-state slot of each row (a request's rows consecutive)
    positions: np.ndarray  # [N] the position of the token each row samples
    inputs: np.ndarray  # [N] each row's input token (a draft for a request's later rows)


class RunnerFeature:
    """One feature of the model runner; every hook does nothing unless overridden."""

    def begin_step(self, so: SchedulerOutput, states: RequestStates) -> None:
        """Before the step's requests are added or removed."""

    def remove_request(self, req_id: str, slot: int | None) -> None:
        """A finished request (slot: its freed request-state slot; None if it had none)."""

    def add_requests(
        self, new_reqs: list[NewRequestData], slots: list[int], states: RequestStates
    ) -> None:
        """The step's new (or resumed) requests, maybe none, and their request-state slots."""

    def prepare_step(self, step: StepInputs) -> None:
        """Before the forward; may change the step's positions and inputs."""

    def adjust_logits(self, logits: torch.Tensor, rows: LogitRows) -> torch.Tensor:
        """Before sampling: the logits to sample from (in place or a new tensor)."""
        return logits

    def after_accept(self, slots: np.ndarray, sampled: np.ndarray, num_sampled: np.ndarray) -> None:
        """The step's emitted tokens per batch row (last stage, before drafting)."""

    def after_step(self, batch: InputBatch, result: StepResult | None) -> None:
        """The step is done (result: the last stage's applied result; None elsewhere)."""

    def bytes(self) -> int:
        """Memory the feature takes from the KV cache's budget."""
        return 0

    def allocate(self) -> None:
        """Allocate that memory (once, with the KV cache)."""


HOOKS = (
    "begin_step",
    "remove_request",
    "add_requests",
    "prepare_step",
    "adjust_logits",
    "after_accept",
    "after_step",
    "allocate",
)


class RunnerFeatures:
    """The active features in step order, and per hook the features that implement it."""

    # The order every hook follows; the order the runner ran them in before they were features.
    ORDER: ClassVar[tuple[str, ...]] = (
        "pp",
        "multimodal",
        "lora",
        "linear_attn",
        "structured_outputs",
        "logit_controls",
    )

    def __init__(self, features: dict[str, RunnerFeature]) -> None:
        unknown = features.keys() - set(self.ORDER)
        if unknown:
            raise ValueError(f"unknown runner features {sorted(unknown)}")
        self.by_name = {n: features[n] for n in self.ORDER if n in features}
        self.all = list(self.by_name.values())
        hooks = {h: [f for f in self.all if _overrides(f, h)] for h in HOOKS}
        self.begin_step = hooks["begin_step"]
        self.remove_request = hooks["remove_request"]
        self.add_requests = hooks["add_requests"]
        self.prepare_step = hooks["prepare_step"]
        self.adjust_logits = hooks["adjust_logits"]
        self.after_accept = hooks["after_accept"]
        self.after_step = hooks["after_step"]
        self.allocate = hooks["allocate"]

    def names(self) -> list[str]:
        return list(self.by_name)

    def bytes(self) -> int:
        return sum(f.bytes() for f in self.all)


def _overrides(feature: RunnerFeature, hook: str) -> bool:
    return getattr(type(feature), hook) is not getattr(RunnerFeature, hook)
