# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculator lifecycle hooks (order and arguments in capture() and propose(), K == 1 skips the
decode pair, an exception leaves no hook state behind), MTP top-k sharing hooks, and the
EAGLE3 aux-hidden-state tap bookkeeping."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import PPGroup, get_pp_group, set_pp_group
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsTopkSharing
from vllm.sequence import IntermediateTensors
from vllm.testing.engine_utils import make_prompts

MAX_SEQS = 4
SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


_HOOKS = {
    "on_prefill_begin": ("prefill_begin", "prefill"),
    "on_prefill_end": ("prefill_end", None),
    "on_multi_step_decode_begin": ("decode_begin", "decode"),
    "on_multi_step_decode_end": ("decode_end", None),
}


def _instrument(spec) -> None:
    """Record every hook call (name, num_reqs) and the open phase, then run the real hook."""
    spec.events = []
    spec.phase = None
    for attr, (name, phase) in _HOOKS.items():
        orig = getattr(spec, attr)

        def hook(num_reqs, orig=orig, name=name, phase=phase):
            spec.events.append((name, num_reqs))
            spec.phase = phase
            orig(num_reqs)

        setattr(spec, attr, hook)


def _make(model: str, k: int) -> tuple[LLM, object]:
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=MAX_SEQS,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
    )
    spec = llm.llm_engine.executor.worker.model_runner.speculator
    _instrument(spec)
    return llm, spec


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in make_prompts(512, [7, 12, 4], seed=2)]


@pytest.fixture(scope="module")
def k2(deepseek_v3_mtp1_dir):
    llm, spec = _make(deepseek_v3_mtp1_dir, 2)
    yield llm, spec
    llm.shutdown()


def _groups(events, size):
    assert len(events) % size == 0, events
    return [events[i : i + size] for i in range(0, len(events), size)]


def test_capture_fires_all_hooks_at_max_num_reqs(k2):
    _, spec = k2
    spec.events.clear()
    spec.capture()
    assert spec.events == [
        ("prefill_begin", MAX_SEQS),
        ("prefill_end", MAX_SEQS),
        ("decode_begin", MAX_SEQS),
        ("decode_end", MAX_SEQS),
    ]


def test_propose_fires_hooks_with_real_num_reqs(k2, prompts):
    llm, spec = k2
    spec.events.clear()
    llm.generate(prompts, SP, use_tqdm=False)
    groups = _groups(spec.events, 4)
    assert len(groups) >= SP.max_tokens - 1
    for g in groups:
        n = g[0][1]
        assert g == [
            ("prefill_begin", n),
            ("prefill_end", n),
            ("decode_begin", n),
            ("decode_end", n),
        ]
        assert 1 <= n <= len(prompts)
    assert groups[0][0][1] == len(prompts)
    assert spec.phase is None


def test_k1_skips_the_decode_pair(deepseek_v3_mtp1_dir, prompts):
    llm, spec = _make(deepseek_v3_mtp1_dir, 1)
    try:
        assert spec.events == []  # capture ran before the class was swapped
        spec.capture()
        assert spec.events == [("prefill_begin", MAX_SEQS), ("prefill_end", MAX_SEQS)]
        spec.events.clear()
        llm.generate(prompts, SP, use_tqdm=False)
        for g in _groups(spec.events, 2):
            assert [e[0] for e in g] == ["prefill_begin", "prefill_end"]
    finally:
        llm.shutdown()


class _RecordingTopk(SupportsTopkSharing):
    """A top-k sharing capability that records what the MTP speculator's hooks ask of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @property
    def shares_topk_across_steps(self) -> bool:
        return True

    def set_skip_topk(self, skip: bool) -> None:
        self.calls.append(("skip", skip))

    def compact_topk_indices(self, rows) -> None:
        self.calls.append(("compact", rows.tolist()))


def test_mtp_topk_sharing_hooks(k2, prompts):
    """With sharing on, the hooks switch the draft's top-k reuse exactly around the decode
    steps and compact the indices of each request's last prefill row."""
    llm, spec = k2
    topk = _RecordingTopk()
    calls = topk.calls
    spec.topk_sharing = topk
    try:
        spec.events.clear()
        llm.generate(prompts[:1], SP, use_tqdm=False)
    finally:
        spec.topk_sharing = None
    first = calls[:4]
    assert first[0] == ("skip", False)
    assert first[1][0] == "compact" and len(first[1][1]) == 1
    assert first[1][1][0] == len(prompts[0]["prompt_token_ids"]) - 1  # last row of the prompt
    assert first[2:] == [("skip", True), ("skip", False)]
    assert len(calls) == len(spec.events)  # one call per hook while sharing is on


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_exception_in_draft_forward_leaves_no_hook_state(k2, prompts, phase):
    llm, spec = k2
    topk = _RecordingTopk()
    spec.topk_sharing = topk
    orig = spec.model.forward

    def forward(*args, **kwargs):
        if spec.phase == phase:
            raise RuntimeError("draft forward failed")
        return orig(*args, **kwargs)

    spec.model.forward = forward
    spec.events.clear()
    try:
        with pytest.raises(RuntimeError, match="draft forward failed"):
            llm.generate(prompts[:1], SP, use_tqdm=False)
    finally:
        del spec.model.forward
        spec.topk_sharing = None
    assert spec.phase is None
    assert spec.events[-1][0] == f"{phase}_end"
    skips = [c[1] for c in topk.calls if c[0] == "skip"]
    assert skips[-1] is False  # top-k reuse switched off again
    # The engine still serves afterwards.
    out = llm.generate(prompts[:1], SP, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == SP.max_tokens


# ---- EAGLE3 aux hidden-state taps -----------------------------------------------------------


class _Decoder(EagleModelMixin):
    supports_aux_hidden_states_over_pp = True

    def __init__(self, start_layer: int) -> None:
        self.start_layer = start_layer


def test_taps_sorted_and_deduplicated():
    d = _Decoder(0)
    d._set_aux_hidden_state_layers((48, 3, 90, 24, 48))
    assert d.aux_hidden_state_layers == (3, 24, 48, 90)


def test_aux_slots_under_pipeline_parallelism():
    import torch

    prev = get_pp_group()
    try:
        # Stage 1 of 2 owns layers [3, 6): taps 0 and 3 come from stage 0 (3 is the stream it
        # sends), tap 5 is local and gets slot 2.
        set_pp_group(PPGroup(rank=1, world_size=2))
        d = _Decoder(3)
        d._set_aux_hidden_state_layers((5, 0, 3))
        layout = d.aux_layout
        assert layout.base == 2 and layout.collects and not layout.relays
        assert layout.upstream_keys() == ("aux_hidden_states_0", "aux_hidden_states_1")
        assert layout.pack([torch.ones(1)]).keys() == {"aux_hidden_states_2"}
        it = IntermediateTensors({"aux_hidden_states_0": torch.zeros(1)})
        with pytest.raises(RuntimeError, match="Missing aux_hidden_states_1"):
            layout.collect(it)
        it["aux_hidden_states_1"] = torch.ones(1)
        assert len(layout.collect(it)) == 2
        # A middle stage of 3 relays the upstream slots with its own.
        set_pp_group(PPGroup(rank=1, world_size=3))
        d._set_aux_hidden_state_layers((5, 0, 3))
        assert d.aux_layout.relays and not d.aux_layout.collects
        assert d.aux_layout.relay(it).keys() == {"aux_hidden_states_0", "aux_hidden_states_1"}
    finally:
        set_pp_group(prev)
    d = _Decoder(0)
    d._set_aux_hidden_state_layers((1, 2))
    assert d.aux_layout.base == 0
    assert d.aux_layout.collect(None) == []
