# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The runner's features (v1/worker/gpu/features.py): each hook calls only the features that
implement it, in one fixed order whatever order they were found in; a real engine's runner
picks its features at load and calls their hooks at the points of a step, and what
adjust_logits returns is what is sampled from."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu.features import (
    HOOKS,
    LogitRows,
    RunnerFeature,
    RunnerFeatures,
    StepInputs,
)
from vllm.v1.worker.gpu.sample.logit_controls import LogitControls
from vllm.v1.worker.gpu.sample.structured_outputs import StructuredOutputStates


class _Logits(RunnerFeature):
    def adjust_logits(self, logits: torch.Tensor, rows: LogitRows) -> torch.Tensor:
        return logits


class _Steps(RunnerFeature):
    def prepare_step(self, step: StepInputs) -> None:
        pass

    def bytes(self) -> int:
        return 7


def test_hooks_list_only_implementers_in_the_fixed_order():
    a, b, c = _Logits(), _Steps(), _Logits()
    # Found in another order than RunnerFeatures.ORDER.
    fs = RunnerFeatures({"logit_controls": a, "linear_attn": b, "structured_outputs": c})
    assert fs.names() == ["linear_attn", "structured_outputs", "logit_controls"]
    assert fs.adjust_logits == [c, a]
    assert fs.prepare_step == [b]
    for hook in set(HOOKS) - {"adjust_logits", "prepare_step"}:
        assert getattr(fs, hook) == [], hook
    assert fs.bytes() == 7
    with pytest.raises(ValueError, match="unknown runner features"):
        RunnerFeatures({"telemetry": a})


class _Recorder(RunnerFeature):
    """Records every hook call; forces token `force` at every sampled row."""

    def __init__(self, force: int) -> None:
        self.force = force
        self.calls: list[tuple] = []

    def begin_step(self, so, states) -> None:
        self.calls.append(("begin_step", so.total_num_scheduled_tokens))

    def remove_request(self, req_id, slot) -> None:
        self.calls.append(("remove_request", req_id, slot))

    def add_requests(self, new_reqs, slots, states) -> None:
        # The slots are taken already: each request's slot is the one given here.
        assert [states.slot(d.req_id) for d in new_reqs] == slots
        if new_reqs:  # called every step
            self.calls.append(("add_requests", sorted(d.req_id for d in new_reqs)))

    def prepare_step(self, step: StepInputs) -> None:
        assert step.inputs_embeds is None and step.positions.dim() == 1
        self.calls.append(("prepare_step", step.batch.num_reqs))

    def adjust_logits(self, logits: torch.Tensor, rows: LogitRows) -> torch.Tensor:
        assert len(rows.slots) == logits.shape[0] == len(rows.positions) == len(rows.inputs)
        self.calls.append(("adjust_logits", logits.shape[0]))
        out = torch.full_like(logits, float("-inf"))
        out[:, self.force] = 0.0
        return out

    def after_accept(self, slots, sampled, num_sampled) -> None:
        assert (sampled[np.arange(len(slots)), 0] == self.force).all()
        self.calls.append(("after_accept", len(slots)))

    def after_step(self, batch, result) -> None:
        self.calls.append(("after_step", batch.num_reqs, result is not None))


class _WithRecorder(RunnerFeatures):
    ORDER: ClassVar[tuple[str, ...]] = (*RunnerFeatures.ORDER, "recorder")


def test_engine_runner_calls_hooks_at_their_points(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", max_model_len=128, enable_prefix_caching=False)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        # A text model at P = 1: the last stage's two features, nothing else.
        assert runner.features.names() == ["structured_outputs", "logit_controls"]
        assert isinstance(runner.features.by_name["structured_outputs"], StructuredOutputStates)
        assert isinstance(runner.features.by_name["logit_controls"], LogitControls)
        assert runner.mm is None and runner.pp_handler is None and runner.lora is None
        rec = _Recorder(force=11)
        runner.features = _WithRecorder({**runner.features.by_name, "recorder": rec})
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], sp, use_tqdm=False
        )
        # The recorder's logits are what was sampled from.
        assert [o.outputs[0].token_ids for o in outs] == [[11, 11, 11]] * 2
        llm.generate([{"prompt_token_ids": [4]}], sp, use_tqdm=False)  # frees the first two
    finally:
        llm.shutdown()
    names = [c[0] for c in rec.calls]
    step = ["begin_step", "prepare_step", "adjust_logits", "after_accept", "after_step"]
    # First step: both prompts enter, are prefilled and sample one token each.
    assert rec.calls[:6] == [
        ("begin_step", 5),
        ("add_requests", ["0", "1"]),
        ("prepare_step", 2),
        ("adjust_logits", 2),
        ("after_accept", 2),
        ("after_step", 2, True),
    ]
    assert names[6:16] == step * 2  # two decode steps
    # The finished requests are removed at the next step, before the new request is added.
    nxt = rec.calls[16:]
    assert nxt[0][0] == "begin_step"
    assert sorted(c[1] for c in nxt if c[0] == "remove_request") == ["0", "1"]
    first_add = names.index("add_requests", 16)
    assert all(c[0] != "remove_request" for c in rec.calls[first_add:])
    assert rec.calls[first_add] == ("add_requests", ["2"])
