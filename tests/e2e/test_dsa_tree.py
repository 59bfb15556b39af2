# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft trees on DeepSeek-V3.2's sparse attention (DSA): a tree node's indexer selects among
its cached context and its ancestors only, and its sparse attention reads nothing else.

The dense reference: one tree-masked forward of the target over a tree's nodes gives, at
every node, the logits of a causal forward over that node's path alone (each path its own
sequence). Then end to end: MTP (one DSA layer, drafts that agree with the target often) with
a static and a dynamic tree, with and without top-k sharing across draft steps, equals no
speculation, greedy and seeded, at P = 1, P = 2 and TP = 2; with sharing, every node of a
draft pass reads its request's step-0 selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.attention.backends.torch_paged import build_attn_metadata
from vllm.forward_context import ALL_SHORT, ForwardContext
from vllm.testing.dsa_checkpoints import make_deepseek_v32
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import make_mtp_self_draft
from vllm.v1.worker.gpu.spec_decode.tree import ancestor_mask

# Shorter and longer than index_topk (8): nodes whose whole context fits in the selection,
# and nodes whose indexer must choose.
LENGTHS = [40, 3, 23, 57, 5, 30, 70]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=8, disable_log_stats=False)
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
DYNAMIC = dict(num_tree_nodes=6, tree_top_k=2, tree_max_depth=4)


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory) -> str:
    return make_deepseek_v32(tmp_path_factory.mktemp("dsa_tree_v32"), num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def near_dirs(v32_dir, tmp_path_factory) -> dict[bool, str]:
    """MTP drafts that reproduce a near-bigram target's next token, top-k shared or not."""
    out = {}
    for share in (False, True):
        src = make_deepseek_v32(
            tmp_path_factory.mktemp(f"dsa_tree_src{int(share)}"),
            num_nextn_predict_layers=1,
            index_share_for_mtp_iteration=share,
        )
        out[share] = make_mtp_self_draft(
            tmp_path_factory.mktemp(f"dsa_tree_near{int(share)}"), src, target_scale=0.2
        )
    return out


# ---- the dense reference --------------------------------------------------------------------


def _forward(model, bs: int, table: np.ndarray, ids, positions, slot_pos, seq_len, tree=None):
    """The target's logits over one request's rows (ids at positions, written to the slots of
    the step positions slot_pos), with an optional tree mask over them."""
    slots = table[slot_pos // bs] * bs + slot_pos % bs
    meta = build_attn_metadata(
        np.array([0, len(ids)]),
        np.array([seq_len]),
        table[None],
        bs,
        torch.device("cpu"),
        slot_mapping=torch.from_numpy(slots),
    )
    if tree is not None:
        meta.tree_mask = torch.from_numpy(tree)[None]
    out = model(
        torch.tensor(ids),
        torch.tensor(positions),
        None,
        None,
        ctx=ForwardContext(meta),
    )
    hidden = out[0] if isinstance(out, tuple) else out
    return model.compute_logits(hidden[: len(ids)], ALL_SHORT)


@pytest.mark.parametrize("ctx_len", [3, 30], ids=["context-fits-topk", "indexer-selects"])
@torch.no_grad()
def test_tree_forward_equals_each_paths_causal_forward(v32_dir, ctx_len):
    """Each node's logits in one tree-masked step equal those of its path run causally; the
    same step without the tree mask (siblings visible) differs - the reference has teeth."""
    llm = LLM(model=v32_dir, dtype="float32", max_model_len=128, max_num_seqs=2)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        model, bs = runner.model, runner.block_size
        per_seq = 64 // bs  # the context and the step fit in 64 positions
        parents = np.array([-1, -1, 0, 0, 1, 2, 3, 5])  # node i's parent (-1: the root)
        mask = ancestor_mask(parents)  # [N + 1, N + 1], row 0 the root
        depth = mask.sum(1) - 1
        g = torch.Generator().manual_seed(3)
        context = torch.randint(0, 500, (ctx_len,), generator=g).tolist()
        step_ids = torch.randint(0, 500, (len(parents) + 1,), generator=g).tolist()

        def table(k: int) -> np.ndarray:  # disjoint blocks (no request holds any)
            return np.arange(1 + k * per_seq, 1 + (k + 1) * per_seq)

        C, M = ctx_len, len(step_ids)
        t0 = table(0)
        pos = np.arange(C)
        _forward(model, bs, t0, context, pos, pos, C)
        tree_logits = _forward(
            model, bs, t0, step_ids, C + depth, C + np.arange(M), C + M, tree=mask
        )
        causal_logits = _forward(model, bs, t0, step_ids, C + depth, C + np.arange(M), C + M)
        for i in range(M):
            path = np.flatnonzero(mask[i])  # the root, the ancestors, the node (increasing)
            ids = context + [step_ids[j] for j in path]
            pos = np.arange(len(ids))
            ref = _forward(model, bs, table(1), ids, pos, pos, len(ids))[-1]  # whole, causal
            torch.testing.assert_close(tree_logits[i], ref, atol=2e-5, rtol=1e-5)
        forked = [i for i in range(M) if mask[i].sum() < i + 1]  # rows with a non-ancestor before
        assert forked
        assert not torch.allclose(causal_logits[forked], tree_logits[forked], atol=1e-3)
    finally:
        llm.shutdown()


# ---- end to end: MTP trees on the DSA target ---------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, LENGTHS, seed=5)


def _spec(kind: str) -> dict:
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False}
    if kind == "static":
        spec["speculative_token_tree"] = TREE
    else:
        spec.update(DYNAMIC)
    return spec


def _run(model: str, prompts, spec=None, **kw):
    sps = [GREEDY if i % 2 else SEEDED for i in range(len(prompts))]
    llm = LLM(model=model, speculative_config=spec, **{**COMMON, **kw})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
        return [list(o.outputs[0].token_ids) for o in outs], metrics
    finally:
        llm.shutdown()


def _accepted_per_depth(metrics) -> list[int]:
    return list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values)


@pytest.mark.parametrize("share", [False, True], ids=["own-topk", "shared-topk"])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_mtp_tree_on_dsa_equals_no_speculation(near_dirs, prompts, kind, share):
    ref, _ = _run(near_dirs[share], prompts)
    got, m = _run(near_dirs[share], prompts, _spec(kind))
    assert got == ref
    per_depth = _accepted_per_depth(m)
    assert per_depth[0] > 0 and per_depth[1] > 0, per_depth  # paths past the first node


def test_mtp_tree_on_glm_dsa_with_a_shared_indexer_layer(prompts, tmp_path_factory):
    """GLM-MoE-DSA: layer 1 has no indexer and reads layer 0's tree-masked selection."""
    from vllm.testing.dsa_checkpoints import make_glm_moe_dsa

    src = make_glm_moe_dsa(
        tmp_path_factory.mktemp("dsa_tree_glm_src"),
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=True,
        indexer_types=["full", "shared", "full", "full"],
    )
    near = make_mtp_self_draft(tmp_path_factory.mktemp("dsa_tree_glm"), src, target_scale=0.2)
    ref, _ = _run(near, prompts)
    got, m = _run(near, prompts, _spec("static"))
    assert got == ref
    assert _accepted_per_depth(m)[1] > 0


def test_mtp_tree_on_dsa_with_chunked_prefill_prefix_hits_and_preemption(near_dirs, prompts):
    """A small token budget (prompts arrive in chunks beside verifying trees), a repeated
    prompt (prefix-cache hits on blocks whose latent and indexer keys were compacted) and a KV
    cache too small for every request (preemption, recompute), top-k shared: the text equals
    the speculation-free run's under the same limits."""
    model = near_dirs[True]
    ps = prompts + [prompts[3][:50] + [7, 8, 9]]
    sps = [GREEDY if i % 2 else SEEDED for i in range(len(ps) + 1)]
    probe = LLM(model=model, speculative_config=_spec("static"), **COMMON)  # with draft KV
    per_block = probe.llm_engine.executor.worker.model_runner.kv_cache_bytes_per_block()
    bs = probe.llm_engine.vllm_config.cache_config.block_size
    probe.shutdown()
    kw = dict(
        max_num_batched_tokens=32,
        max_model_len=10 * bs - 7,
        kv_cache_memory_bytes=10 * per_block,
        enable_prefix_caching=True,
    )

    def run(spec):
        llm = LLM(model=model, speculative_config=spec, **{**COMMON, **kw})
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], sps[:-1], use_tqdm=False)
            # The last prompt again: its blocks are still cached.
            outs += llm.generate([{"prompt_token_ids": ps[-1]}], sps[-1], use_tqdm=False)
            m = {x.name: x for x in llm.get_metrics()}
            return [list(o.outputs[0].token_ids) for o in outs], m
        finally:
            llm.shutdown()

    ref, _ = run(None)
    got, m = run(_spec("static"))
    assert got == ref
    assert m["vllm:num_preemptions"].value > 0
    assert m["vllm:prefix_cache_hits"].value > 0
    assert _accepted_per_depth(m)[1] > 0


@pytest.mark.usefixtures("pp_forkserver")
@pytest.mark.parametrize(
    "par", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)], ids=["pp2", "tp2"]
)
def test_mtp_tree_on_dsa_pipeline_and_tensor_parallel(near_dirs, prompts, par):
    """P = 2 (the first stage compacts its latent and indexer-key caches from the broadcast
    result) and TP = 2 (replicated indexers), top-k shared: equal to no speculation at P = 1."""
    ref, _ = _run(near_dirs[True], prompts)
    got, m = _run(near_dirs[True], prompts, _spec("static"), **par)
    assert got == ref
    assert _accepted_per_depth(m)[1] > 0


def test_tree_nodes_read_their_roots_step0_selection(near_dirs, prompts):
    """With sharing, every node pass of a draft tree skips the draft's indexer and each of a
    request's nodes reads the row its root (the request's last accepted token) selected in the
    draft's step 0."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLAAttention

    llm = LLM(model=near_dirs[True], speculative_config=_spec("static"), **COMMON)
    try:
        spec = llm.llm_engine.executor.worker.model_runner.speculator
        assert spec.share_mtp_topk_indices
        draft = spec.model
        buf = draft.bound_shares.topk_indices_buffer
        indexers = [a.indexer for a in draft.model.attentions()]
        state: dict = {"step0": None, "roots": None, "passes": []}
        orig_forward, orig_tree_pass = draft.forward, spec.tree_pass

        def forward(*args, **kwargs):
            calls = sum(ix.num_calls for ix in indexers)
            if kwargs["spec_step_idx"] == 0:
                state["roots"] = None
            out = orig_forward(*args, **kwargs)
            if kwargs["spec_step_idx"] == 0:
                state["step0"] = buf.clone()
            else:  # a node pass: the indexers did not run
                assert sum(ix.num_calls for ix in indexers) == calls
            return out

        def tree_pass(roots, nodes):
            if state["roots"] is None:  # the first node pass: roots are step 0's last rows
                state["roots"] = roots.copy()
            state["nodes"] = nodes
            return orig_tree_pass(roots, nodes)

        def reading(impl):
            orig = impl.topk_slots

            def topk_slots(meta):
                if state["roots"] is not None:
                    n, R = state["nodes"], len(state["roots"])
                    got = buf[: R * n].view(R, n, -1)
                    want = state["step0"][torch.from_numpy(state["roots"])][:, None]
                    state["passes"].append(torch.equal(got, want.expand_as(got)))
                return orig(meta)

            return topk_slots

        impls = [m.impl for m in draft.modules() if isinstance(m, SparseMLAAttention)]
        for impl in impls:
            impl.topk_slots = reading(impl)
        draft.forward, spec.tree_pass = forward, tree_pass
        try:
            llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        finally:
            del draft.forward, spec.tree_pass
            for impl in impls:
                del impl.topk_slots
        assert state["passes"] and all(state["passes"]), state["passes"]
        assert not any(a.skip_topk for a in draft.model.attentions())
    finally:
        llm.shutdown()
