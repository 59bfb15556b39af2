# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EAGLE3 aux hidden states across pipeline stages, simulated in one process: each stage of a
real LlamaModel (with stub decoder layers that clobber their inputs in place) is built under a
fake PP group, and each stage's output reaches the next over gloo into the buffers the next
stage's own factory made; the last stage must return exactly the taps a single-stage run
returns. Also: the target keeps its embedding on the last stage for EAGLE
drafts under PP."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import vllm.model_executor.models.llama as llama_mod
from tests.v1.worker.test_pp_utils import _gloo_pair, _run_ranks
from vllm.distributed.parallel_state import (
    PPGroup,
    get_pp_group,
    recv_tensor_dict,
    send_tensor_dict,
    set_pp_group,
)
from vllm.forward_context import ForwardContext
from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
    set_eagle3_aux_hidden_state_layers,
    verify_supports_aux_hidden_states_over_pp,
)

H, V, N = 8, 32, 6
CFG = SimpleNamespace(
    vocab_size=V, hidden_size=H, num_hidden_layers=N, rms_norm_eps=1e-6, tie_word_embeddings=False
)
KEY = "aux_hidden_states_"


class _StubLayer(nn.Module):
    """A deterministic decoder layer that mutates the residual it is given in place, so a tap
    aliasing a live buffer would be caught."""

    def __init__(self, config, qkv_bias, prefix: str) -> None:
        super().__init__()
        self.idx = int(prefix.rsplit(".", 1)[1])

    def forward(self, positions, hidden, residual, ctx):
        if residual is None:
            residual = hidden.clone()
        else:
            residual.add_(hidden)
        hidden.mul_(0.0)  # clobber the incoming buffer too
        return torch.sin(residual * (self.idx + 1)), residual


class _Target(nn.Module, SupportsEagle3):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.config = CFG
        self.model = inner
        self.make_empty_intermediate_tensors = inner.make_empty_intermediate_tensors


class _NoRelayDecoder(nn.Module):
    supports_aux_hidden_states_over_pp = False


class _NoRelayTarget(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _NoRelayDecoder()


@pytest.fixture(autouse=True)
def _restore_pp_group():
    old = get_pp_group()
    yield
    set_pp_group(old)


def _draft_cfg(taps) -> SimpleNamespace:
    return SimpleNamespace(
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True}
    )


def _build(rank: int, world: int, taps, embed: torch.Tensor, monkeypatch) -> _Target:
    monkeypatch.setattr(llama_mod, "LlamaDecoderLayer", _StubLayer)
    set_pp_group(PPGroup(rank=rank, world_size=world))
    target = _Target(llama_mod.LlamaModel(CFG))
    if not isinstance(target.model.embed_tokens, PPMissingLayer):
        target.model.embed_tokens.weight.data.copy_(embed)
    set_eagle3_aux_hidden_state_layers(target, _draft_cfg(taps))
    return target


ROWS = 16  # the receive buffers' rows (max_num_batched_tokens in the engine)


def _aux_keys(it: IntermediateTensors) -> set[str]:
    return {k for k in it.keys() if k.startswith(KEY)}


def _receive(groups, sent: IntermediateTensors, buffers: dict) -> IntermediateTensors:
    """What the next stage gets of `sent`: a real transfer (gloo, two threads) into its
    buffers, as the worker receives."""
    got: dict = {}

    def sender() -> None:
        send_tensor_dict(sent.tensors, 1, device_group=groups[0], cpu_group=groups[0]).wait()

    def receiver() -> None:
        got.update(recv_tensor_dict(0, buffers, device_group=groups[1], cpu_group=groups[1]))

    _run_ranks([sender, receiver])
    return IntermediateTensors(got)


def _run_staged(taps, world: int, monkeypatch, drop: str | None = None):
    """(P = 1 output, P = world output, aux keys each non-last stage sent, per receiving stage
    (its receive buffers, what it received))."""
    torch.manual_seed(0)
    embed = torch.randn(V, H)
    ids = torch.randint(0, V, (5,))
    pos = torch.arange(5)
    ref = _build(0, 1, taps, embed, monkeypatch)
    ref_out = ref.model(ids, pos, ctx=ForwardContext())  # no attention metadata: a dry run
    groups = _gloo_pair()
    it = None
    stage_keys, received = [], []
    for rank in range(world):
        target = _build(rank, world, taps, embed, monkeypatch)
        if rank > 0:
            # What the runner allocates once: the model's own factory, aux slots included.
            made = target.make_empty_intermediate_tensors(ROWS, torch.float32, "cpu")
            buffers = dict(made.tensors)
            # Exactly the slots the stage before sends (checked first: a transfer the receiver
            # refuses would leave the sender waiting).
            assert sorted(buffers) == sorted(it.keys()), (rank, taps)
            if drop is not None and rank == world - 1:
                del it.tensors[drop]
            it = _receive(groups, it, buffers)
            received.append((buffers, it))
        out = target.model(ids if rank == 0 else None, pos, it, ctx=ForwardContext())
        if rank < world - 1:
            stage_keys.append(sorted(_aux_keys(out)))
            it = out
    return ref_out, out, stage_keys, received


@pytest.mark.parametrize(
    "taps",
    [(0, 3, 6), (0, 1, 3), (4, 5, 6), (1, 2), (3,), (2, 3, 4)],
    ids=["boundary_and_ends", "first_stage", "last_stage", "first_only", "on_boundary", "mixed"],
)
def test_pp2_taps_match_single_stage(taps, monkeypatch):
    ref, out, stage_keys, _ = _run_staged(taps, 2, monkeypatch)
    # Layers split [0, 3) / [3, 6): the first stage sends the taps at or before layer 3.
    assert stage_keys[0] == sorted(f"{KEY}{i}" for i, t in enumerate(taps) if t <= 3)
    ref_hidden, ref_aux = ref
    hidden, aux = out
    assert len(aux) == len(taps)
    torch.testing.assert_close(hidden, ref_hidden)
    for a, b in zip(aux, ref_aux):
        torch.testing.assert_close(a, b)


def test_pp4_relays_through_two_middle_stages_into_factory_buffers(monkeypatch):
    """6 layers over 4 stages: [0,1) [1,3) [3,5) [5,6); taps 0 and 1 come from the first stage
    and travel through both middle stages, 3 sits on the 2nd/3rd boundary. Every receiving
    stage's buffers come from its model's make_empty_intermediate_tensors, with exactly the aux
    slots the stage before sends, and what arrives lands in them."""
    taps = (0, 1, 3, 6)
    ref, out, stage_keys, received = _run_staged(taps, 4, monkeypatch)
    assert stage_keys == [
        [f"{KEY}0", f"{KEY}1"],
        [f"{KEY}0", f"{KEY}1", f"{KEY}2"],
        [f"{KEY}0", f"{KEY}1", f"{KEY}2"],
    ]
    for keys, (buffers, got) in zip(stage_keys, received):
        assert sorted(buffers) == sorted(["hidden_states", "residual", *keys])
        assert sorted(got.keys()) == sorted(buffers)
        for key, t in got.items():
            assert t.untyped_storage().data_ptr() == buffers[key].untyped_storage().data_ptr()
            assert t.shape == (5, H) and buffers[key].shape == (ROWS, H)
    for a, b in zip(out[1], ref[1]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(out[0], ref[0])


def test_missing_slot_raises(monkeypatch):
    # Dropped before the transfer: the last stage's collect, not a zero-filled buffer, sees it.
    with pytest.raises(RuntimeError, match="Missing aux_hidden_states_1"):
        _run_staged((0, 3, 6), 2, monkeypatch, drop=f"{KEY}1")


def test_no_taps_carries_only_hidden_and_residual(monkeypatch):
    monkeypatch.setattr(llama_mod, "LlamaDecoderLayer", _StubLayer)
    set_pp_group(PPGroup(rank=0, world_size=2))
    out = llama_mod.LlamaModel(CFG)(torch.arange(3), torch.arange(3), ctx=ForwardContext())
    assert set(out.keys()) == {"hidden_states", "residual"}
    set_pp_group(PPGroup(rank=1, world_size=2))
    last = _Target(llama_mod.LlamaModel(CFG))
    assert isinstance(last.model(None, torch.arange(3), out, ctx=ForwardContext()), torch.Tensor)


def test_model_without_opt_in_is_refused():
    with pytest.raises(ValueError, match="_NoRelayTarget does not support eagle3 with pipeline"):
        verify_supports_aux_hidden_states_over_pp(_NoRelayTarget(), "eagle3")


@pytest.mark.parametrize(
    "method,world,expected",
    [
        ("eagle3", 2, True),
        ("eagle", 2, True),
        ("dflash", 4, True),
        ("eagle3", 1, False),
        ("mtp", 2, False),
        (None, 2, False),
    ],
)
def test_target_embed_on_last_stage_truth_table(method, world, expected):
    """EAGLE-family drafts may share the target's embedding: under PP the target keeps it on
    the last stage (test_last_stage_builds_embed_for_eagle_draft: only there)."""
    from vllm.config import SpeculativeConfig, VllmConfig

    spec = None if method is None else SpeculativeConfig(method=method, model="draft")
    cfg = SimpleNamespace(
        speculative_config=spec, parallel_config=SimpleNamespace(pipeline_parallel_size=world)
    )
    assert VllmConfig.target_embed_on_last_stage.fget(cfg) is expected


def test_last_stage_builds_embed_for_eagle_draft(monkeypatch):
    monkeypatch.setattr(llama_mod, "LlamaDecoderLayer", _StubLayer)
    set_pp_group(PPGroup(rank=1, world_size=2))
    assert isinstance(llama_mod.LlamaModel(CFG).embed_tokens, PPMissingLayer)
    assert isinstance(llama_mod.LlamaModel(CFG, keep_embed=True).embed_tokens, nn.Embedding)
