# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The EAGLE3 first pass deferred while nobody drafts (spec_decode/autoregressive/deferral.py).

A plan gives whole steps where no request drafts (runs of them, so kept rows pile up over
decode steps and over verify steps with rejected drafts), between steps where the requests draft
different counts. Two waves of requests, the second extending the first's prompts and answers
(prefix-cache hits on blocks whose rows were kept when their request finished). Checked against
the same engine with the deferral off:
- every draft (all of propose's output, and a dynamic tree's parents) is the same at every
  step, chains and trees: the catch-up before a pass and the flush when a request leaves write
  the draft KV the deferred passes would have, and requests drafting while others keep their
  rows draft from their own rows laid out alone;
- the text equals no speculation's, and the draft KV at every position a request computed is
  bit-identical (the catch-up runs the rows through the same small-M kernel route);
- rows were kept, caught up before a pass and flushed after their request left;
- with a slot holding at most 3 rows, rows that would outgrow it are caught up first.
Each mechanism is load-bearing: a catch-up that writes nothing, or no flush, changes drafts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import make_eagle3_draft
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.worker.gpu.spec_decode.autoregressive.deferral import FirstPassDeferral

K = 3
BLOCK = 16
# Step t: nobody drafts where DORMANT[t % len] (runs of 1 .. 4 steps), else request i drafts
# (t + i) % (K + 1).
DORMANT = [False, True, True, False, True, True, True, True, False, False, True]
PROMPTS = make_prompts(512, [21, 6, 13], seed=41)
# Each request's computed positions (prompt + max_tokens - 1) end on a block boundary (16
# tokens): the rows it leaves its slot with lie in full blocks, which the second wave hits.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=28, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=27, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
]


@pytest.fixture(scope="module")
def head(llama_dir, tmp_path_factory):
    return make_eagle3_draft(tmp_path_factory.mktemp("deferral_eagle3"), llama_dir)


def _engine(target: str, spec: dict | None, prefix_caching: bool = True) -> LLMEngine:
    args = EngineArgs(
        model=target,
        speculative_config=spec,
        dtype="float32",
        max_model_len=160,
        max_num_seqs=3,
        enable_prefix_caching=prefix_caching,
    )
    return LLMEngine.from_engine_args(args)


def _wave(
    eng: LLMEngine, prompts: list[list[int]], tag: str, params: list[SamplingParams] = PARAMS
) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"{tag}{i}", {"prompt_token_ids": p}, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def _run(
    target: str,
    spec: dict | None,
    deferral: str = "on",
    prefix_caching: bool = True,
    repeat: bool = False,
):
    """Two waves (the second: each prompt + its first answer + a few tokens; repeat: the same
    prompts again); the outputs, every propose's drafts, and the speculator's deferral."""
    eng = _engine(target, spec, prefix_caching)
    drafts: list[np.ndarray] = []
    parents: list[np.ndarray] = []  # a dynamic tree's, after each propose
    written: set[int] = set()
    sp_obj = None
    try:
        if spec is not None:
            policy = eng.scheduler.spec_k
            assert policy is not None
            decide, t = policy.decide, [0]

            def planned(req_ids, batch_size):
                decide(req_ids, batch_size)
                step, t[0] = t[0], t[0] + 1
                reqs = [eng.scheduler.requests[rid] for rid in req_ids]
                # Dormant too near a request's end: it leaves its slot with rows kept.
                ending = any(r.sampling_params.max_tokens - r.num_output_tokens < 6 for r in reqs)
                ks = {
                    rid: 0 if ending or DORMANT[step % len(DORMANT)] else (step + i) % (K + 1)
                    for i, rid in enumerate(req_ids)
                }
                for rid, k in ks.items():
                    policy._req(rid).k_next = k
                return ks

            policy.decide = planned  # type: ignore[method-assign]
            sp_obj = eng.executor.worker.model_runner.speculator
            if deferral == "off":  # (a hybrid's: its draft model's)
                getattr(sp_obj, "drafter", sp_obj).deferral = None
            elif deferral == "small":
                d = sp_obj.deferral
                sp_obj.deferral = FirstPassDeferral(sp_obj, d.width, sp_obj.dtype, 3)
            propose = sp_obj.propose

            def recording(inputs):
                got = propose(inputs)
                drafts.append(got.copy())
                if "num_tree_nodes" in spec:
                    parents.append(sp_obj.tree_parents.copy())
                # The draft KV slots of every valid position of the step's requests.
                b = inputs.input_batch
                last = b.positions_np[inputs.last_valid_indices()]
                for i, n in enumerate(last.tolist()):
                    pos = np.arange(n + 1)
                    blocks = b.block_table_np[i, pos // BLOCK]
                    written.update((blocks * BLOCK + pos % BLOCK).tolist())
                return got

            sp_obj.propose = recording
        first = _wave(eng, PROMPTS, "a")
        second_prompts = PROMPTS if repeat else [p + o + [7, 8, 9] for p, o in zip(PROMPTS, first)]
        second = _wave(eng, second_prompts, "b")
        kv = None
        if sp_obj is not None:
            # One more step: the second wave's kept rows are flushed as it starts (a prefill of
            # more rows than a decode step, and nothing after it: nothing of its own is kept).
            _wave(eng, [list(range(5, 17))], "c", [SamplingParams(max_tokens=1)])
            runner = eng.executor.worker.model_runner
            n_slots = runner.num_blocks * BLOCK
            # Each draft cache's positions first ([2, slots, ...] K/V; [slots, ...] MLA, keys).
            kv = {
                n: (c if c.shape[0] == n_slots else c.transpose(0, 1)).clone()
                for n, c in runner.kv_caches.items()
                if n.startswith("drafter")
            }
        deferral = sp_obj.deferral if sp_obj is not None else None
        return first + second, drafts + parents, deferral, kv, written
    finally:
        eng.shutdown()


def _assert_same_as_without(run: tuple, run_off: tuple, want: list[list[int]]):
    """The deferring run and the no-deferral one: both emit `want`, every propose returned the
    same drafts, and every draft cache is bit-identical at each position a request computed.
    Returns the deferring run's FirstPassDeferral."""
    out, drafts, d, kv, written = run
    out_off, drafts_off, d_off, kv_off, written_off = run_off
    assert d is not None and d_off is None
    assert out == want and out_off == want
    assert len(drafts) == len(drafts_off)
    for step, (a, b) in enumerate(zip(drafts, drafts_off)):
        assert np.array_equal(a, b), (step, a, b)
    assert written == written_off
    slots = torch.tensor(sorted(written))
    assert kv.keys() == kv_off.keys() and kv
    for name, cache in kv.items():
        assert torch.equal(cache[slots], kv_off[name][slots]), name
    return d


@pytest.fixture(scope="module")
def reference(llama_dir):
    return _run(llama_dir, None)[0]


SHAPES = {
    "chain": {"num_speculative_tokens": K},
    "static_tree": {"speculative_token_tree": "[(0,), (1,), (0, 0)]"},
    "dynamic_tree": {"num_tree_nodes": K, "tree_top_k": 2},
    # The head beside suffix decoding: rows the suffix proposer serves are kept too.
    "hybrid": {
        "num_speculative_tokens": 8,
        "hybrid_method": "suffix",
        "hybrid_model_num_speculative_tokens": K,
    },
}


def _spec(head: str, shape: str = "chain") -> dict:
    return {
        "method": "eagle3",
        "model": head,
        "adaptive_num_speculative_tokens": False,
        **SHAPES[shape],
    }


@pytest.fixture(scope="module")
def without(llama_dir, head):
    runs: dict[str, tuple] = {}

    def get(shape: str) -> tuple:
        if shape not in runs:
            runs[shape] = _run(llama_dir, _spec(head, shape), deferral="off")
        return runs[shape]

    return get


@pytest.mark.parametrize(
    "shape, mode",
    [("chain", "on"), ("chain", "small"), ("static_tree", "on"), ("dynamic_tree", "on")],
)
def test_deferred_first_pass_drafts_exactly_the_same(
    llama_dir, head, reference, without, shape, mode
):
    run = _run(llama_dir, _spec(head, shape), deferral=mode)
    d = _assert_same_as_without(run, without(shape), reference)
    assert sum(int((a >= 0).sum()) for a in run[1]) >= 40, "the plan drafts"
    assert d.num_deferred_rows >= 60, d.num_deferred_rows
    # Steps where some requests drafted and the others kept their rows.
    assert d.num_partial_steps >= 5, d.num_partial_steps
    # Kept rows were written before a pass and after their request left.
    assert d.num_flushed_rows > 0
    assert d.num_caught_up_rows - d.num_flushed_rows > 0
    if mode == "small":
        assert d.num_overflows > 0
    assert d.num_deferred_rows == d.num_caught_up_rows and not d.count.any()


def test_a_count_forced_on_every_request_never_defers(llama_dir, head, reference):
    """The start-up's step-cost measurement forces one count on all (policy.force_k): those
    steps must cost what a drafting batch's steps cost, first pass included."""
    eng = _engine(llama_dir, _spec(head))
    try:
        policy = eng.scheduler.spec_k
        assert policy is not None
        policy.force_k = 0
        spec_obj = eng.executor.worker.model_runner.speculator
        d = spec_obj.deferral
        assert d is not None
        passes = []
        run_model = spec_obj._run_model

        def counting(input_ids, *a, **kw):
            passes.append(int(input_ids.shape[0]))
            return run_model(input_ids, *a, **kw)

        spec_obj._run_model = counting
        assert _wave(eng, PROMPTS, "f") == reference[: len(PROMPTS)]
        assert d.num_deferred_rows == 0
        assert len(passes) >= max(sp.max_tokens for sp in PARAMS) - 1, passes
    finally:
        eng.shutdown()


def test_without_prefix_caching_rows_leave_with_their_request(llama_dir, head, reference):
    """Nothing can read a finished request's blocks without prefix caching: its kept rows are
    dropped, not flushed, and every draft is still the no-deferral engine's."""
    out, drafts, d, _, _ = _run(llama_dir, _spec(head), prefix_caching=False)
    out_off, drafts_off, *_ = _run(llama_dir, _spec(head), deferral="off", prefix_caching=False)
    assert out == reference and out_off == reference
    assert len(drafts) == len(drafts_off)
    for step, (a, b) in enumerate(zip(drafts, drafts_off)):
        assert np.array_equal(a, b), (step, a, b)
    assert d.num_flushed_rows == 0 and d.num_dropped_rows > 0
    assert d.num_caught_up_rows > 0


def test_rows_a_hybrids_draft_free_proposer_serves_are_kept(
    llama_dir, head, reference, monkeypatch
):
    """EAGLE3 beside suffix decoding: where suffix serves a request the scheduler wants drafts
    for, the head drafts nothing for it and keeps its rows instead of running its first pass
    on them, as for an idle request - the drafts, the text and the draft KV are the
    no-deferral engine's."""
    from vllm.v1.worker.gpu.spec_decode.hybrid import HybridSpeculator

    served_and_kept = [0]
    propose = HybridSpeculator.propose

    def spy(self, inputs):
        got = propose(self, inputs)
        d, ks = self.drafter.deferral, inputs.req_draft_steps
        if d is not None and ks is not None:
            free_wanted = self.last_use_free & (np.asarray(ks) > 0)
            slots = inputs.input_batch.idx_mapping_np[free_wanted]
            served_and_kept[0] += int((d.count[slots] > 0).sum())
        return got

    monkeypatch.setattr(HybridSpeculator, "propose", spy)
    # The second wave repeats the first: suffix matches the first wave's answers.
    spec = _spec(head, "hybrid")
    run = _run(llama_dir, spec, repeat=True)
    assert served_and_kept[0] > 0
    run_off = _run(llama_dir, spec, deferral="off", repeat=True)
    d = _assert_same_as_without(run, run_off, reference[: len(PROMPTS)] * 2)
    assert d.num_deferred_rows > 0 and d.num_flushed_rows > 0


@pytest.fixture(scope="module")
def mtp_target(deepseek_v3_mtp1_dir, tmp_path_factory):
    """DeepSeek-V3 with one MTP layer that often agrees with it, whose drafts also read the
    draft's own KV (its block's attention kept, scaled)."""
    from vllm.testing.spec_checkpoints import make_mtp_self_draft

    return make_mtp_self_draft(
        tmp_path_factory.mktemp("deferral_mtp"),
        deepseek_v3_mtp1_dir,
        target_scale=0.2,
        draft_block_scale=0.5,
    )


@pytest.fixture(scope="module")
def dsa_mtp_target(tmp_path_factory):
    """DeepSeek-V3.2 with one MTP layer (sparse MLA + its own indexer: two draft caches), top-k
    shared across draft steps, drafts that often agree and read the draft's own KV."""
    from vllm.testing.dsa_checkpoints import make_deepseek_v32
    from vllm.testing.spec_checkpoints import make_mtp_self_draft

    src = make_deepseek_v32(
        tmp_path_factory.mktemp("deferral_v32_src"),
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=True,
    )
    return make_mtp_self_draft(
        tmp_path_factory.mktemp("deferral_v32"), src, target_scale=0.2, draft_block_scale=0.5
    )


@pytest.mark.parametrize(
    "model, shape",
    [
        ("v3", "chain"),
        ("v3", "static_tree"),
        ("v3", "dynamic_tree"),
        ("v32", "chain"),
        ("v32", "dynamic_tree"),
        ("bundled", "static_tree"),
        ("bundled", "dynamic_tree"),
    ],
)
def test_one_layer_mtp_defers_its_first_pass_too(request, model, shape):
    """An MTP draft with one layer (MLA; DeepSeek-V3.2: sparse MLA and its indexer's key
    cache; the bundled model's two layers under a tree, which drafts with the first only)
    keeps its rows while nobody drafts: the drafts, the text and every draft cache are the
    no-deferral engine's."""
    from vllm.config import default_model_path

    if model == "bundled":
        target = str(default_model_path())
    else:
        target = request.getfixturevalue("mtp_target" if model == "v3" else "dsa_mtp_target")
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, **SHAPES[shape]}
    run = _run(target, spec)
    d = _assert_same_as_without(run, _run(target, spec, deferral="off"), _run(target, None)[0])
    assert sum(int((a >= 0).sum()) for a in run[1]) >= 40
    assert d.num_deferred_rows >= 60 and d.num_partial_steps >= 5 and d.num_flushed_rows > 0


def test_qwen3_5_mtp_defers_its_first_pass_too(tmp_path_factory):
    """Qwen3.5's MTP layer (full attention beside a hybrid target): the same drafts, text and
    draft KV with the deferral as without it."""
    from vllm.testing.qwen3_5_checkpoints import make_qwen3_5

    target = make_qwen3_5(tmp_path_factory.mktemp("deferral_q35"), mtp_num_hidden_layers=1)
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": K}
    run, run_off = _run(target, spec), _run(target, spec, deferral="off")
    d = _assert_same_as_without(run, run_off, _run(target, None)[0])
    assert d.num_deferred_rows >= 60 and d.num_flushed_rows > 0


def test_chained_mtp_layers_do_not_defer():
    """The bundled model's two MTP layers as a chain (layer 1 reads layer 0's output at every
    position) run their first pass every step; as a tree (the first layer only) they defer."""
    from vllm.config import default_model_path

    for spec, defers in (
        ({"method": "mtp", "num_speculative_tokens": 2}, False),
        ({"method": "mtp", "speculative_token_tree": "[(0,), (1,), (0, 0)]"}, True),
    ):
        eng = _engine(str(default_model_path()), spec)
        try:
            d = eng.executor.worker.model_runner.speculator.deferral
            assert (d is not None) == defers, spec
        finally:
            eng.shutdown()
