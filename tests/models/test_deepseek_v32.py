# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DeepSeek-V3.2 and GLM-MoE-DSA end to end. Target: full-vocab logprobs and greedy tokens equal
HF transformers' (fp32) with contexts shorter and longer than index_topk (prefill, chunked
prefill, decode, yarn RoPE); P = 2 equals P = 1. MTP draft (DeepseekV32MTP): greedy output with
top-k sharing on and off equals no speculation, draft steps 1.. skip the indexer, sharing changes
no draft when index_topk covers the context, the sharing hooks drive the real draft, and draft
loading re-points its top-k buffers to the target's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.checkpoints import copy_checkpoint
from vllm.testing.dsa_checkpoints import make_deepseek_v32, make_glm_moe_dsa
from vllm.testing.engine_utils import assert_logprobs_match_hf, hf_greedy, hf_logprobs, make_prompts

INDEX_TOPK = 8  # the builders' default: prompts of 21+ tokens select a strict subset
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """3-layer V3.2 with two MTP layers (the target skips them) and top-k sharing across draft
    steps switched on."""
    return make_deepseek_v32(
        tmp_path_factory.mktemp("v32"),
        num_nextn_predict_layers=2,
        index_share_for_mtp_iteration=True,
    )


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4-layer GLM-MoE-DSA: interleaved indexer RoPE, layer 2 "shared"; one MTP layer."""
    return make_glm_moe_dsa(
        tmp_path_factory.mktemp("glm"),
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=True,
    )


@pytest.fixture(scope="module")
def v32_yarn_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """V3.2 with yarn RoPE as the real checkpoints use (the indexer shares the scaled cos/sin
    and the MLA softmax scale gets mscale^2)."""
    return make_deepseek_v32(tmp_path_factory.mktemp("v32_yarn"), rope_scaling=dict(YARN))


@pytest.fixture(scope="module", params=["v32_dir", "glm_dir", "v32_yarn_dir"])
def family(request):
    path = request.getfixturevalue(request.param)
    # A small token budget: the 40-token prompt is prefilled in chunks (the indexer then scores
    # against cached keys) and the top-k buffer has only 32 rows.
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        block_size=8,
        max_num_batched_tokens=32,
        max_logprobs=-1,  # the HF parity checks read every token's logprob
    )
    yield path, llm
    llm.shutdown()


def _dense_copy(path: str, tmp_path: Path) -> str:
    """The same checkpoint with index_topk beyond any context (HF then attends densely)."""
    return copy_checkpoint(path, tmp_path / "dense", {"index_topk": 4096})


@pytest.mark.parametrize("prompt_len", [6, 21], ids=["short", "long"])
def test_logprobs_match_hf(family, prompt_len: int, tmp_path: Path) -> None:
    path, llm = family
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = make_prompts(vocab, [prompt_len], seed=1)[0]
    sp = SamplingParams(
        temperature=0, max_tokens=5, logprobs=-1, prompt_logprobs=-1, ignore_eos=True
    )
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    gen = list(out.outputs[0].token_ids)
    ref = assert_logprobs_match_hf(path, out, prompt)
    if prompt_len + len(gen) > INDEX_TOPK + 1:
        # The selection matters here: dense attention would be far off.
        dense = hf_logprobs(_dense_copy(path, tmp_path), prompt + gen)
        assert (dense[INDEX_TOPK + 1 :] - ref[INDEX_TOPK + 1 :]).abs().max() > 0.1


def test_greedy_matches_hf_generate(family) -> None:
    path, llm = family
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = make_prompts(vocab, [5, 17, 40], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(path, p, 12)


# ---- MTP drafting (DeepseekV32MTP) and top-k sharing across draft steps -----------------------

K = 3
MTP_PROMPTS = make_prompts(512, [30, 5, 12], seed=5)
MTP_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MTP_COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4)


def _variant(src: str, dst: Path, **cfg) -> str:
    """A copy of checkpoint src with config.json fields replaced (same weights)."""
    return str(dst) if dst.exists() else copy_checkpoint(src, dst, cfg)


@pytest.fixture(scope="module")
def variants(v32_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("v32_variants")
    return {
        "v32_share": v32_dir,
        "v32_noshare": _variant(v32_dir, root / "noshare", index_share_for_mtp_iteration=False),
        # index_topk beyond every context: the selection is always everything.
        "wide_share": _variant(v32_dir, root / "wide_share", index_topk=64),
        "wide_noshare": _variant(
            v32_dir, root / "wide_noshare", index_topk=64, index_share_for_mtp_iteration=False
        ),
    }


def _mtp_llm(path: str, k: int, **kw) -> LLM:
    return LLM(
        model=path,
        speculative_config={
            "method": "mtp",
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        },
        **{**MTP_COMMON, **kw},
    )


def _draft_indexers(spec) -> list:
    from vllm.models.deepseek_v32.model import DeepseekV32Indexer

    return [m for m in spec.model.modules() if isinstance(m, DeepseekV32Indexer)]


def _generate_ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in MTP_PROMPTS], MTP_GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spec_run(path: str, k: int = K) -> dict:
    """Greedy tokens, every propose()'s drafts, and the draft indexers' calls while serving."""
    llm = _mtp_llm(path, k)
    try:
        spec = llm.llm_engine.executor.worker.model_runner.speculator
        indexers = _draft_indexers(spec)
        for m in indexers:
            m.num_calls = 0  # capture() ran at start-up
        drafts: list[list[list[int]]] = []
        orig = spec.propose

        def propose(inputs):
            out = orig(inputs)
            drafts.append(out.tolist())  # [num_reqs, K] int64 array
            return out

        spec.propose = propose
        tokens = _generate_ids(llm)
        return {
            "tokens": tokens,
            "drafts": drafts,
            "indexer_calls": sum(m.num_calls for m in indexers),
            "share": spec.share_mtp_topk_indices,
        }
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def no_spec():
    cache: dict[str, list[list[int]]] = {}

    def get(path: str) -> list[list[int]]:
        if path not in cache:
            llm = LLM(model=path, **MTP_COMMON)
            try:
                cache[path] = _generate_ids(llm)
            finally:
                llm.shutdown()
        return cache[path]

    return get


@pytest.mark.parametrize(
    "name, share", [("v32_share", True), ("v32_noshare", False), ("glm", True)]
)
def test_mtp_greedy_lossless_and_indexer_calls(variants, glm_dir, no_spec, name, share) -> None:
    path = glm_dir if name == "glm" else variants[name]
    run = _spec_run(path)
    assert run["share"] is share
    assert run["tokens"] == no_spec(path)
    # Step 0 (the prefill pass) always selects; steps 1.. do only without sharing.
    steps_with_indexer = 1 if share else K
    assert run["indexer_calls"] == steps_with_indexer * len(run["drafts"])


def test_sharing_changes_nothing_when_topk_covers_context(variants, no_spec) -> None:
    on, off = _spec_run(variants["wide_share"]), _spec_run(variants["wide_noshare"])
    assert on["share"] and not off["share"]
    assert on["drafts"] == off["drafts"]
    assert on["tokens"] == off["tokens"] == no_spec(variants["wide_share"])
    assert on["indexer_calls"] < off["indexer_calls"]


@pytest.fixture(scope="module")
def k2_llm(v32_dir):
    llm = _mtp_llm(v32_dir, 2)
    yield llm
    llm.shutdown()


def test_binding_repoints_topk_buffers_to_the_target(k2_llm) -> None:
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLAAttention

    runner = k2_llm.llm_engine.executor.worker.model_runner
    target_buf = runner.model.model.topk_indices_buffer
    draft = runner.speculator.model
    assert draft.bound_shares.topk_indices_buffer is target_buf
    indexers = _draft_indexers(runner.speculator)
    assert len(indexers) == 2  # one per MTP layer
    assert all(m.topk_indices_buffer is target_buf for m in indexers)
    attns = [m for m in draft.modules() if isinstance(m, SparseMLAAttention)]
    assert len(attns) == 2 and all(a.topk_indices_buffer is target_buf for a in attns)
    # The binding re-pointed the owners (the indexers); the impls still resolve through them.
    other = torch.zeros_like(target_buf)
    indexers[0].topk_indices_buffer = other
    try:
        assert attns[0].topk_indices_buffer is other
    finally:
        indexers[0].topk_indices_buffer = target_buf


def test_impls_read_the_target_buffer_through_their_indexers(
    v32_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draft loading re-points the draft indexers (the buffer's owners); the draft's sparse
    impls reach the target's buffer only by resolving it through them. An impl that took a
    snapshot of its buffer at construction (before loading) has none to read: the draft's first
    sparse attention fails."""
    from vllm.attention.backends.mla.sparse_common import SharedTopkIndicesBuffer

    init = SharedTopkIndicesBuffer.init_topk_indices_buffer

    def snapshot(self, indexer=None, buffer=None):
        init(self, None, indexer.topk_indices_buffer if indexer is not None else buffer)

    monkeypatch.setattr(SharedTopkIndicesBuffer, "init_topk_indices_buffer", snapshot)
    llm = None
    try:
        # Start-up's warm-up already runs draft steps over contexts longer than index_topk;
        # else the 30-token prompt's would.
        with pytest.raises(RuntimeError, match="has no top-k indices buffer"):
            llm = _mtp_llm(v32_dir, 2)
            _generate_ids(llm)
    finally:
        if llm is not None:
            llm.shutdown()


def test_the_draft_allocates_no_topk_buffer_of_its_own(
    v32_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.models.deepseek_v32.model as v32_model
    import vllm.models.deepseek_v32.mtp as v32_mtp

    made: list[tuple] = []
    new = v32_model.new_topk_indices_buffer

    def counting(*args):
        buf = new(*args)
        made.append(tuple(buf.shape))
        return buf

    for module in (v32_model, v32_mtp):
        monkeypatch.setattr(module, "new_topk_indices_buffer", counting, raising=False)
    llm = _mtp_llm(v32_dir, 2)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        assert made == [tuple(runner.model.model.topk_indices_buffer.shape)]  # the target's
    finally:
        llm.shutdown()


def _record_sharing(spec) -> tuple[list, callable]:
    """Record set_skip_topk / compact_topk_indices calls on the real draft (calling through)
    and the skip_topk state every draft forward sees; returns (log, undo)."""
    draft, inner = spec.model, spec.model.model
    log: list[tuple] = []
    set_skip, compact, fwd = draft.set_skip_topk, draft.compact_topk_indices, draft.forward

    def skip(flag):
        log.append(("skip", flag))
        set_skip(flag)

    def comp(idx):
        log.append(("compact", idx.tolist()))
        compact(idx)

    def forward(*args, **kwargs):
        states = {layer.mtp_block.self_attn.skip_topk for layer in inner.layers.values()}
        log.append(("forward", kwargs.get("spec_step_idx"), states))
        return fwd(*args, **kwargs)

    draft.set_skip_topk, draft.compact_topk_indices, draft.forward = skip, comp, forward

    def undo():
        del draft.set_skip_topk, draft.compact_topk_indices, draft.forward

    return log, undo


def test_sharing_hooks_in_capture_and_propose(k2_llm) -> None:
    spec = k2_llm.llm_engine.executor.worker.model_runner.speculator
    assert spec.share_mtp_topk_indices
    log, undo = _record_sharing(spec)
    try:
        spec.capture()
        R, q = MTP_COMMON["max_num_seqs"], 3  # capture: K + 1 = 3 rows per request
        assert log == [
            ("skip", False),
            ("forward", 0, {False}),
            ("compact", list(range(R * q))),
            ("skip", True),
            ("forward", 1, {True}),
            ("skip", False),
        ]
        log.clear()
        prompt = MTP_PROMPTS[0]
        k2_llm.generate([{"prompt_token_ids": prompt}], MTP_GREEDY, use_tqdm=False)
    finally:
        undo()
    steps = [log[i : i + 6] for i in range(0, len(log), 6)]
    assert len(steps) * 6 == len(log) and len(steps) >= 2
    # Two chained MTP layers: step 1 runs layer 1 over every position whose KV it lacks, so on
    # the prefill step every prompt row continues its own step-0 row.
    assert steps[0][2] == ("compact", list(range(len(prompt))))
    for s in steps:
        assert [e[0] for e in s] == ["skip", "forward", "compact", "skip", "forward", "skip"]
        assert s[0] == ("skip", False) and s[1][2] == {False}
        # decode: step 0 ran over at most K + 1 = 3 rows; each step-1 row reuses one of them
        assert s[2][1] and all(0 <= r < 3 for r in s[2][1]) or s is steps[0]
        assert s[3] == ("skip", True) and s[4][1:] == (1, {True}) and s[5] == ("skip", False)


def test_k1_does_not_compact_or_skip(v32_dir) -> None:
    llm = _mtp_llm(v32_dir, 1)
    try:
        spec = llm.llm_engine.executor.worker.model_runner.speculator
        assert spec.share_mtp_topk_indices
        log, undo = _record_sharing(spec)
        try:
            spec.capture()
            llm.generate([{"prompt_token_ids": MTP_PROMPTS[1]}], MTP_GREEDY, use_tqdm=False)
        finally:
            undo()
    finally:
        llm.shutdown()
    assert log and {e[0] for e in log} == {"skip", "forward"}
    assert all(e == ("skip", False) for e in log if e[0] == "skip")


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_exception_mid_propose_leaves_skip_topk_false(k2_llm, no_spec, v32_dir, phase) -> None:
    spec = k2_llm.llm_engine.executor.worker.model_runner.speculator
    layers = list(spec.model.model.layers.values())
    orig = spec.model.forward

    def forward(*args, **kwargs):
        in_decode = any(layer.mtp_block.self_attn.skip_topk for layer in layers)
        if in_decode == (phase == "decode"):
            raise RuntimeError("draft forward failed")
        return orig(*args, **kwargs)

    spec.model.forward = forward
    try:
        with pytest.raises(RuntimeError, match="draft forward failed"):
            k2_llm.generate([{"prompt_token_ids": MTP_PROMPTS[2]}], MTP_GREEDY, use_tqdm=False)
    finally:
        del spec.model.forward
    assert not any(layer.mtp_block.self_attn.skip_topk for layer in layers)
    # The engine still serves, losslessly.
    out = k2_llm.generate([{"prompt_token_ids": MTP_PROMPTS[2]}], MTP_GREEDY, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == no_spec(v32_dir)[2]


def test_target_pp2_equals_p1(v32_dir, no_spec) -> None:
    """Each stage's indexers fill that stage's own top-k buffer."""
    llm = LLM(model=v32_dir, pipeline_parallel_size=2, **MTP_COMMON)
    try:
        assert _generate_ids(llm) == no_spec(v32_dir)
    finally:
        llm.shutdown()


def test_glm_pp2_needs_stages_that_start_at_a_full_indexer_layer(
    glm_dir, no_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 2 of the GLM checkpoint is "shared": a stage may not start there."""
    reference = no_spec(glm_dir)  # P = 1, before the partition is set
    with pytest.raises(Exception, match="starts at layer 2, whose indexer_types entry"):
        LLM(model=glm_dir, pipeline_parallel_size=2, **MTP_COMMON)  # split [2, 2]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    llm = LLM(model=glm_dir, pipeline_parallel_size=2, **MTP_COMMON)
    try:
        assert _generate_ids(llm) == reference
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["v32_share", "v32_noshare"])
def test_mtp_greedy_lossless_pp2(variants, no_spec, name) -> None:
    """The draft (with the target's top-k buffer) lives on the last of two stages."""
    path = variants[name]
    llm = _mtp_llm(path, K, pipeline_parallel_size=2)
    try:
        assert _generate_ids(llm) == no_spec(path)
    finally:
        llm.shutdown()


def test_draft_steps_read_the_step0_selection_of_each_requests_last_token(
    v32_two_index_heads_dir,
) -> None:
    """With sharing on and index_topk (8) narrower than the context, the selection every
    sparse attention of draft steps 1.. reads is, row for row, what the draft's step-0 indexer
    selected at each request's last valid token: the rows the prefill pass left, taken at the
    rows an independent reading of the batch names (query start + scheduled - rejected - 1).
    Without compact_topk_indices the decode rows would read the step-0 rows 0 .. R-1."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLAAttention

    llm = _mtp_llm(v32_two_index_heads_dir, K)
    try:
        spec = llm.llm_engine.executor.worker.model_runner.speculator
        assert spec.share_mtp_topk_indices
        draft = spec.model
        buf = draft.bound_shares.topk_indices_buffer
        state: dict = {"step": None}
        log: list[tuple] = []
        orig_propose, orig_forward = spec.propose, draft.forward

        def propose(inputs):
            b = inputs.input_batch
            last = b.query_start_loc_np[:-1] + b.num_scheduled_tokens - inputs.step.num_rejected - 1
            log.append(("propose", torch.from_numpy(last.astype("int64"))))
            return orig_propose(inputs)

        def forward(*args, **kwargs):
            state["step"] = kwargs["spec_step_idx"]
            out = orig_forward(*args, **kwargs)
            if state["step"] == 0:
                log.append(("step0", buf.clone()))
            return out

        def reading(impl):
            orig = impl.topk_slots

            def topk_slots(meta):
                log.append(("read", state["step"], buf[: meta.num_tokens].clone()))
                return orig(meta)

            return topk_slots

        impls = [m.impl for m in draft.modules() if isinstance(m, SparseMLAAttention)]
        for impl in impls:
            impl.topk_slots = reading(impl)
        spec.propose, draft.forward = propose, forward
        try:
            _generate_ids(llm)
        finally:
            del spec.propose, draft.forward
            for impl in impls:
                del impl.topk_slots
    finally:
        llm.shutdown()
    checked = moved = 0
    last = step0 = None
    for entry in log:
        if entry[0] == "propose":
            last, step0 = entry[1], None
        elif entry[0] == "step0":
            step0 = entry[1]
        elif entry[1] >= 1:
            assert step0 is not None and len(entry[2]) == len(last)
            assert torch.equal(entry[2], step0[last])
            checked += 1
            moved += int(not torch.equal(last, torch.arange(len(last))))
    assert checked > 0 and moved > 0, (checked, moved)


# ---- top-k ties: the selection must not depend on the batch layout ------------------------------


def test_topk_breaks_ties_toward_the_lower_position() -> None:
    from vllm.models.deepseek_v32.model import topk_lowest_position_first

    g = torch.Generator().manual_seed(0)
    # Few distinct values (many ties, +0.0 and -0.0 among them) and -inf padding.
    x = torch.randint(-2, 3, (64, 40), generator=g).float()
    x[x == -2] = float("-inf")
    x[:, ::7] = -0.0
    for k in (1, 8, 40):
        vals, idx = topk_lowest_position_first(x, k)
        ref = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(idx, ref.indices[:, :k])
        assert torch.equal(vals, ref.values[:, :k])


@pytest.fixture(scope="module")
def v32_two_index_heads_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2 indexer heads: a key whose every head the ReLU clips scores exactly 0, so scores tie at
    the top-k boundary often."""
    return make_deepseek_v32(
        tmp_path_factory.mktemp("v32_2heads"),
        index_n_heads=2,
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=True,
    )


def test_tied_index_scores_give_the_same_tokens_batched_alone_and_with_mtp(
    v32_two_index_heads_dir,
) -> None:
    path = v32_two_index_heads_dir
    prompts = make_prompts(512, [30, 45, 12, 60, 25], seed=5)
    llm = LLM(model=path, **MTP_COMMON)
    try:
        alone = [
            list(
                llm.generate([{"prompt_token_ids": p}], MTP_GREEDY, use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
            for p in prompts
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], MTP_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == alone
    llm = _mtp_llm(path, 2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], MTP_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == alone
