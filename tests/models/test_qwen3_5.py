# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention, dense and MoE) against HF transformers,
their per-request state slots (chunked prefill, preemption, batching), and MTP speculation with
state rollback.

References are independent of our engine: HF transformers' Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM on the same checkpoint (fp32), a per-token recurrence for the chunked
kernel, and the engine without speculation for lossless speculation.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d
from vllm.model_executor.layers.mamba.ops.gated_delta_rule import (
    chunked_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from vllm.testing import qwen3_5_checkpoints as q35
from vllm.testing.engine_utils import assert_logprobs_match_hf, hf_greedy, make_prompts
from vllm.v1.worker.gpu.linear_attn_states import LinearAttnStates

FAMILIES = ["qwen3_5_dir", "qwen3_5_moe_dir"]
# max_logprobs=-1: the HF parity checks read every token's logprob (vLLM caps them at 20).
COMMON = dict(dtype="float32", max_model_len=256, block_size=8, max_logprobs=-1)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Prompt lengths: a 1-token prompt (padded path), short ones, and one above the chunk size (64).
LENGTHS = [1, 5, 17, 70]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # Tiny tensors: intra-op threads only contend on a shared machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gen(llm: LLM, prompts, sp=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- kernels ----------------------------------------------------------------------------------


def _gdr_inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H, dk, dv = 2, 3, 8, 5
    q = l2norm(torch.randn(B, length, H, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(B, length, H, dk, generator=g))
    v = torch.randn(B, length, H, dv, generator=g)
    decay = -torch.rand(B, length, H, generator=g) * 3
    beta = torch.rand(B, length, H, generator=g)
    s0 = torch.randn(B, H, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


def test_chunked_gated_delta_rule_matches_recurrence():
    q, k, v, decay, beta, s0 = _gdr_inputs(150)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, decay, beta, s0)
    for chunk in (64, 7):
        o, s = chunked_gated_delta_rule(q, k, v, decay, beta, s0, chunk_size=chunk)
        torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-4)
    # keep_states returns the state after every step; the last one is the final state.
    _, kept = recurrent_gated_delta_rule(q, k, v, decay, beta, s0, keep_states=True)
    assert kept.shape[1] == 150
    torch.testing.assert_close(kept[:, -1], s_ref)
    # Prefix-cache checkpoints: chunks cut at the kept steps, the states after them equal the
    # recurrence's, and the output is unchanged.
    at = [5, 64, 100, 150]
    states: list[torch.Tensor] = []
    o, s = chunked_gated_delta_rule(q, k, v, decay, beta, s0, keep_at=at, kept=states)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-4)
    assert len(states) == len(at)
    for step, st in zip(at, states):
        torch.testing.assert_close(st, kept[:, step - 1], atol=1e-5, rtol=1e-4)


def test_states_carry_across_pieces():
    """A sequence processed in pieces (conv state + recurrent state carried) equals one pass."""
    q, k, v, decay, beta, s0 = _gdr_inputs(40, seed=1)
    o_all, s_all = recurrent_gated_delta_rule(q, k, v, decay, beta, s0)
    o1, s1 = chunked_gated_delta_rule(
        q[:, :23], k[:, :23], v[:, :23], decay[:, :23], beta[:, :23], s0
    )
    o2, s2 = chunked_gated_delta_rule(
        q[:, 23:], k[:, 23:], v[:, 23:], decay[:, 23:], beta[:, 23:], s1
    )
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_all, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s2, s_all, atol=1e-5, rtol=1e-4)

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 30, generator=g)
    w = torch.randn(6, 4, generator=g)
    zero = torch.zeros(2, 6, 3)
    y_all, _ = causal_conv1d(x, w, zero)
    y1, padded = causal_conv1d(x[..., :2], w, zero)  # a piece shorter than the state
    y2, padded = causal_conv1d(x[..., 2:11], w, padded[..., -3:])
    y3, _ = causal_conv1d(x[..., 11:], w, padded[..., -3:])
    torch.testing.assert_close(torch.cat([y1, y2, y3], dim=-1), y_all)


def test_state_position_follows_num_computed():
    """A verify pass of 1 + d tokens keeps d + 1 states; the next step starts from the one after
    its last accepted token, whatever was rejected."""
    st = LinearAttnStates(
        {}, num_slots=4, num_speculative_tokens=3, dtype=torch.float32, device=torch.device("cpu")
    )
    qsl = np.array([0, 10])
    st.prepare(qsl, np.array([0]), np.array([0]), np.array([2]), short_query_len=4)  # prefill
    meta = st.prepare(np.array([0, 4]), np.array([10]), np.array([3]), np.array([2]), 4)
    assert meta.init_index.tolist() == [0] and meta.has_initial_state.tolist() == [[True]]
    assert meta.short is not None and meta.short.store_pos.tolist() == [0, 1, 2, 3]
    for accepted in range(4):  # verify [10, 14): num_computed = 10 + 1 + accepted
        st.base_pos[2], st.num_stored[2] = 10, 4
        meta = st.prepare(
            np.array([0, 1]), np.array([11 + accepted]), np.array([0]), np.array([2]), 4
        )
        assert meta.init_index.tolist() == [accepted]
    with pytest.raises(RuntimeError, match="no linear-attention state"):
        st.prepare(np.array([0, 1]), np.array([30]), np.array([0]), np.array([2]), 4)


def test_scheduler_hands_out_state_slots_with_blocks():
    """Hybrid models: each running request holds a state slot next to its blocks; preemption
    frees both and the request comes back (as new) with a slot again; finishing frees it."""
    from tests.v1.core.test_scheduler import _answer, _config, _req
    from vllm.v1.core.sched.scheduler import Scheduler

    s = Scheduler(_config(budget=64, block_size=4), num_blocks=5, num_state_slots=2)
    a, b = _req("a", 8, max_tokens=12), _req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    kv = s.kv_cache_manager
    slots: dict[str, list[int]] = {"a": [], "b": []}
    preempted_freed = False
    for _ in range(60):
        so = s.schedule()
        for nr in so.scheduled_new_reqs:
            assert nr.state_slot == kv.req_to_state_slot[nr.req_id]
            slots[nr.req_id].append(nr.state_slot)
        if b.status.name == "PREEMPTED":
            preempted_freed |= "b" not in kv.req_to_state_slot
        if so.total_num_scheduled_tokens == 0:
            break
        # Two live requests never share a slot.
        assert len(set(kv.req_to_state_slot.values())) == len(kv.req_to_state_slot)
        s.update_from_output(so, _answer(so))
    assert b.num_preemptions >= 1 and preempted_freed and len(slots["b"]) >= 2
    assert a.is_finished() and b.is_finished()
    assert not kv.req_to_state_slot and sorted(kv._free_state_slots) == [0, 1]


# ---- parity with HF transformers ----------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = request.getfixturevalue(request.param)
    llm = LLM(model=path, **COMMON)
    yield path, llm
    llm.shutdown()


def test_logprobs_match_hf(family):
    """Full-vocabulary logprobs of every prompt position (prefill) and of decode steps."""
    path, llm = family
    prompt = make_prompts(llm.llm_engine.model_config.vocab_size, [70], seed=1)[0]
    sp = SamplingParams(
        temperature=0, max_tokens=5, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
    )
    assert_logprobs_match_hf(path, _gen(llm, [prompt], sp)[0], prompt)


def test_greedy_matches_hf_and_is_batch_invariant(family):
    path, llm = family
    prompts = make_prompts(llm.llm_engine.model_config.vocab_size, LENGTHS, seed=2)
    batched = _ids(_gen(llm, prompts))
    assert batched == [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    # Logprobs of one request do not depend on what else is in the batch.
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    alone = _gen(llm, [prompts[2]], sp)[0].outputs[0].logprobs
    mixed = _gen(llm, prompts, sp)[2].outputs[0].logprobs
    for a, b in zip(alone, mixed):
        assert list(a) == list(b)
        torch.testing.assert_close(
            torch.tensor([x.logprob for x in a.values()]),
            torch.tensor([x.logprob for x in b.values()]),
            atol=1e-5,
            rtol=0,
        )
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.num_state_slots == llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    assert not kv.req_to_state_slot and len(kv._free_state_slots) == kv.num_state_slots


@pytest.mark.parametrize("model", FAMILIES)
def test_chunked_prefill_matches_hf(request, model):
    """Prompts split into 8-token chunks (the states carry over) next to decoding requests."""
    path = request.getfixturevalue(model)
    llm = LLM(model=path, enable_chunked_prefill=True, max_num_batched_tokens=8, **COMMON)
    try:
        vocab = llm.llm_engine.model_config.vocab_size
        prompt = make_prompts(vocab, [37], seed=3)[0]
        sp = SamplingParams(
            temperature=0, max_tokens=5, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
        )
        assert_logprobs_match_hf(path, _gen(llm, [prompt], sp)[0], prompt)
        prompts = make_prompts(vocab, LENGTHS, seed=2)
        assert _ids(_gen(llm, prompts)) == [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    finally:
        llm.shutdown()


def test_preemption_matches_hf(qwen3_5_dir):
    """Too few KV blocks for the batch: requests are preempted (state slot freed) and recomputed
    (state rebuilt), and the output is still HF's; the states are paid for from the budget."""
    probe = LLM(model=qwen3_5_dir, **COMMON)
    runner = probe.llm_engine.executor.worker.model_runner
    per_block = runner.kv_cache_bytes_per_block()
    state_bytes = runner.state_cache_bytes()
    max_seqs = probe.llm_engine.vllm_config.scheduler_config.max_num_seqs
    probe.shutdown()
    # Conv + recurrent state of each linear-attention layer, for every slot and every
    # prefix-cache checkpoint (2 x max_num_seqs by default).
    conv = (2 * 2 * 16 + 4 * 16) * 3 * 4
    rec = 4 * 16 * 16 * 4
    assert state_bytes == 2 * (conv + rec) * (max_seqs + 2 * max_seqs)
    # max_model_len within the pool's 14 x 8 tokens (a longer one is refused at start-up).
    llm = LLM(
        model=qwen3_5_dir,
        kv_cache_memory_bytes=state_bytes + per_block * 14,
        **{**COMMON, "max_model_len": 112},
    )
    try:
        kv = llm.llm_engine.scheduler.kv_cache_manager
        assert kv.num_blocks == 14
        prompts = make_prompts(llm.llm_engine.model_config.vocab_size, [40, 33, 21, 9], seed=4)
        outs = _ids(
            _gen(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        )
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert outs == [hf_greedy(qwen3_5_dir, p, 24) for p in prompts]
        assert not kv.req_to_state_slot and len(kv._free_state_slots) == kv.num_state_slots
    finally:
        llm.shutdown()


def test_multimodal_checkpoint_runs_text_path(qwen3_5_dir, tmp_path):
    """`Qwen3_5ForConditionalGeneration` layout: language_model names, the vision tower loaded
    on the first stage, nested config, no image processor (text prompts only, images refused
    naming why); logits equal HF's text model on the plain checkpoint."""
    path = q35.make_multimodal_layout(tmp_path / "vl", qwen3_5_dir)
    llm = LLM(model=path, **COMMON)
    try:
        model = llm.llm_engine.executor.worker.model_runner.model
        assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
        assert any(n.startswith("visual.blocks.0.") for n, _ in model.named_parameters())
        prompt = make_prompts(llm.llm_engine.model_config.vocab_size, [12], seed=6)[0]
        sp = SamplingParams(
            temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
        )
        assert_logprobs_match_hf(qwen3_5_dir, _gen(llm, [prompt], sp)[0], prompt)
        with pytest.raises(ValueError, match="image processor"):
            llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": []}})
    finally:
        llm.shutdown()


def test_mtp_needs_mtp_weights(qwen3_5_dir, tmp_path):
    from vllm.model_executor.models.interfaces import supports_pp
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MoeMTP, Qwen3_5MTP

    # The drafts build on the last stage of a pipeline, where only the last stage drafts.
    assert supports_pp(Qwen3_5MTP) and supports_pp(Qwen3_5MoeMTP)
    spec = {
        "method": "qwen3_5_mtp",
        "adaptive_num_speculative_tokens": False,
        "num_speculative_tokens": 1,
    }
    # No MTP layers declared.
    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(qwen3_5_dir, no_cfg)
    cfg = json.loads((no_cfg / "config.json").read_text())
    del cfg["mtp_num_hidden_layers"]
    (no_cfg / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(model=str(no_cfg), speculative_config=spec, **COMMON)
    # Declared, but the weights were stripped.
    no_w = tmp_path / "no_weights"
    shutil.copytree(qwen3_5_dir, no_w)
    tensors = {k: v for k, v in q35._read(no_w).items() if not k.startswith("mtp.")}
    q35._write(no_w, tensors)
    with pytest.raises(ValueError, match="mtp.\\* weights"):
        LLM(model=str(no_w), speculative_config=spec, **COMMON)


# ---- speculative decoding ---------------------------------------------------------------------

SPEC_LENGTHS = [40, 23, 9, 3]


def _spec_run(path: str, prompts, k: int, **kw):
    llm = LLM(
        model=path,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
        disable_log_stats=False,
        max_num_seqs=8,
        **{**COMMON, **kw},
    )
    try:
        outs = _ids(_gen(llm, prompts))
        m = {
            x.name: x.value
            for x in llm.get_metrics()
            if x.name.startswith("vllm:spec_decode") and hasattr(x, "value")
        }
        return outs, (
            m["vllm:spec_decode_num_draft_tokens"],
            m["vllm:spec_decode_num_accepted_tokens"],
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "model,k", [("qwen3_5_dir", 1), ("qwen3_5_dir", 3), ("qwen3_5_moe_dir", 3)]
)
def test_mtp_lossless_with_rejections(request, model, k):
    """A random MTP head: nearly every draft is rejected, so every step rolls the
    linear-attention states back; the output is still HF's greedy one."""
    path = request.getfixturevalue(model)
    prompts = make_prompts(512, SPEC_LENGTHS, seed=5)
    outs, (drafted, accepted) = _spec_run(path, prompts, k)
    assert outs == [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    assert drafted > 0 and accepted < drafted / 2


def test_mtp_self_draft_accepts_everything(qwen3_5_self_draft_dir):
    prompts = make_prompts(512, SPEC_LENGTHS, seed=5)
    outs, (drafted, accepted) = _spec_run(qwen3_5_self_draft_dir, prompts, 3)
    assert outs == [hf_greedy(qwen3_5_self_draft_dir, p, GREEDY.max_tokens) for p in prompts]
    assert drafted > 0 and accepted == drafted


def test_mtp_partial_acceptance_with_chunked_prefill_and_preemption(qwen3_5_near_self_draft_dir):
    """Drafts accepted part of the way (rollback to a middle position), prompts in 8-token
    chunks, and too few KV blocks (preemption drops the states, recompute rebuilds them)."""
    path = qwen3_5_near_self_draft_dir
    probe = LLM(
        model=path,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": 2,
        },
        max_num_seqs=8,
        **COMMON,
    )
    runner = probe.llm_engine.executor.worker.model_runner
    per_block, states = runner.kv_cache_bytes_per_block(), runner.state_cache_bytes()
    probe.shutdown()
    prompts = make_prompts(512, SPEC_LENGTHS, seed=5)
    outs, (drafted, accepted) = _spec_run(
        path,
        prompts,
        2,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        kv_cache_memory_bytes=states + per_block * 10,
        max_model_len=10 * 8 - 2,  # the pool's tokens less K
    )
    assert outs == [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    assert 0 < accepted < drafted


# ---- speculative decoding under pipeline parallelism ------------------------------------------


def test_pp2_matches_hf(qwen3_5_dir):
    """Two stages without speculation: each keeps the states of its own linear-attention layers
    through chunked prefill and decode."""
    prompts = make_prompts(512, LENGTHS, seed=2)
    llm = LLM(
        model=qwen3_5_dir,
        pipeline_parallel_size=2,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        **COMMON,
    )
    try:
        outs = _ids(_gen(llm, prompts))
    finally:
        llm.shutdown()
    assert outs == [hf_greedy(qwen3_5_dir, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize(
    "model,k",
    [
        ("qwen3_5_near_self_draft_dir", 3),
        ("qwen3_5_moe_dir", 1),
        ("qwen3_5_self_draft_dir", 3),
    ],
)
def test_mtp_pp2_equals_p1(request, model, k):
    """Two stages, each with linear-attention and full-attention layers: the non-last stage rolls
    its states back from the num_rejected the last one broadcasts. Tokens and acceptance equal
    P = 1 and HF; the self-draft head (the fc input branch on the last, non-first stage) still
    accepts every draft, the random MoE head almost none (rollback every step)."""
    path = request.getfixturevalue(model)
    prompts = make_prompts(512, SPEC_LENGTHS, seed=5)
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=16)
    p1, counts1 = _spec_run(path, prompts, k, **kw)
    p2, counts2 = _spec_run(path, prompts, k, pipeline_parallel_size=2, **kw)
    assert p2 == p1 == [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    assert counts2 == counts1
    drafted, accepted = counts2
    if model == "qwen3_5_self_draft_dir":
        assert accepted == drafted > 0
    elif model == "qwen3_5_moe_dir":
        assert accepted < drafted / 2
    else:
        assert 0 < accepted < drafted
