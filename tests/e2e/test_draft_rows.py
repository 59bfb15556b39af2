# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Per-request draft depth: the worker drafts only what each request verifies next step.

The scheduler hands the worker each request's draft count (SchedulerOutput.req_draft_steps).
An EAGLE3 chain runs draft step s only over the requests whose count reaches past s; a static
or dynamic tree runs its node passes only over the requests that verify any node, each pass as
wide as the deepest of them needs. Checked with a plan that gives the requests of one batch
different counts every step (0 .. K, cycling), greedy and seeded requests together:
- every draft pass runs exactly the rows the counts call for (a spy on the draft's forward);
- the drafts a request gets (and a dynamic tree's parents) equal its first drafts of the same
  step drafted the old way, every request at the batch's largest count (the subset passes
  read the right rows' hidden states, positions and blocks);
- each request's columns past its count are PAD_TOKEN_ID;
- the text equals the text without speculation;
- with two requests under a grammar (grammar-aware drafting masks each drafting row with its
  own request's grammar), no draft the grammar forbids reaches verification.
"""

from __future__ import annotations

import ast
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.engine_utils import make_prompts, run_to_completion
from vllm.testing.spec_checkpoints import make_eagle3_draft
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.worker.gpu.spec_decode.tree import StaticTree
from vllm.v1.worker.gpu.states import PAD_TOKEN_ID

K = 3
TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"
CONFIGS = {
    "chain": {"num_speculative_tokens": K},
    "chain_grammar": {"num_speculative_tokens": K},
    "static_tree": {"speculative_token_tree": TREE},
    "dynamic_tree": {"num_tree_nodes": 6, "tree_top_k": 2},
}
PROMPTS = make_prompts(512, [17, 5, 26, 9], seed=23)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=3, max_tokens=9, ignore_eos=True),
]
DIGITS = "[0-9]*"
GRAMMAR_PARAMS = [
    SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        seed=sp.seed,
        max_tokens=sp.max_tokens,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex=DIGITS) if i in (0, 2) else None,
    )
    for i, sp in enumerate(PARAMS)
]
# Request i's count at scheduling step t: PLAN[(t + 2 i) % len(PLAN)] (capped at the tree's
# nodes): different counts in one batch, each request through 0 and its maximum.
PLAN = [0, 3, 1, 6, 2, 0, 4]


@pytest.fixture(scope="module")
def head(llama_dir, tmp_path_factory):
    return make_eagle3_draft(tmp_path_factory.mktemp("rows_eagle3"), llama_dir)


def _engine(target: str, spec: dict | None) -> LLMEngine:
    args = EngineArgs(
        model=target,
        speculative_config=spec,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
    )
    return LLMEngine.from_engine_args(args)


def _expected_pass_rows(cfg: str, ks: np.ndarray, num_nodes: int) -> list[int]:
    """Rows of each draft pass after the first, for these counts."""
    active = ks[ks > 0]
    if not len(active):
        return []
    want = int(active.max())
    if cfg.startswith("chain"):
        return [int((ks > s).sum()) for s in range(1, want)]
    if cfg == "static_tree":
        tree = StaticTree(list(ast.literal_eval(TREE)))
        depth = tree.depth[:want]
        return [len(active) * int((depth <= d).sum()) for d in range(1, int(depth.max()))]
    return []  # dynamic: the pass widths depend on the step's scores; checked via drafts


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_each_request_drafts_only_its_count(llama_dir, head, cfg):
    params = GRAMMAR_PARAMS if cfg == "chain_grammar" else PARAMS
    ref = run_to_completion(_engine(llama_dir, None), PROMPTS, params)

    spec = {
        "method": "eagle3",
        "model": head,
        "adaptive_num_speculative_tokens": False,
        **CONFIGS[cfg],
    }
    eng = _engine(llama_dir, spec)
    policy = eng.scheduler.spec_k
    assert policy is not None
    num_nodes = policy.K
    decide = policy.decide
    calls = 0

    def planned(req_ids, batch_size):
        nonlocal calls
        decide(req_ids, batch_size)
        ks = {rid: min(PLAN[(calls + 2 * int(rid)) % len(PLAN)], num_nodes) for rid in req_ids}
        calls += 1
        for rid, k in ks.items():
            policy._req(rid).k_next = k  # what the scheduler clips the next verify to
        return ks

    policy.decide = planned  # type: ignore[method-assign]

    spec_obj = eng.executor.worker.model_runner.speculator
    passes: list[int] = []  # rows of each draft forward of the real propose
    recording = False
    run_model = spec_obj._run_model

    def counting_run_model(input_ids, *a, **kw):
        if recording:
            passes.append(int(input_ids.shape[0]))
        return run_model(input_ids, *a, **kw)

    spec_obj._run_model = counting_run_model
    draft = spec_obj._draft
    checked = {"steps": 0, "mixed": 0, "drafts": 0}

    def checking_draft(db, hidden, num_steps=None):
        nonlocal recording
        ks = np.asarray(num_steps)
        assert ks.shape == (db.num_reqs,), "the worker got one count per request"
        # The same step drafted for every request at the batch's largest count first (its
        # writes are scratch the real call rewrites), then the real call. (Not under a
        # grammar: drafting advances the rows' grammar forks.)
        full = None
        if spec_obj.draft_grammar is None:
            full = draft(db, hidden, int(ks.max()) if len(ks) else 0)
        full_parents = spec_obj.tree_parents.copy() if cfg == "dynamic_tree" else None
        passes.clear()
        recording = True
        try:
            got = draft(db, hidden, num_steps)
        finally:
            recording = False
        assert passes[0] == len(db.input_ids), "the first pass runs over the whole step"
        expect = _expected_pass_rows(cfg, ks, num_nodes)
        if cfg != "dynamic_tree":
            assert passes[1:] == expect, (ks.tolist(), passes)
        elif not (ks > 0).any():
            assert passes[1:] == []
        else:
            assert all(p % int((ks > 0).sum()) == 0 for p in passes[1:]), (ks.tolist(), passes)
        for r, k in enumerate(ks.tolist()):
            assert (got[r, k:] == PAD_TOKEN_ID).all()
            if full is not None:
                assert got[r, :k].tolist() == full[r, :k].tolist(), (r, ks.tolist())
            if full_parents is not None:
                parents = spec_obj.tree_parents[r, :k].tolist()
                assert parents == full_parents[r, :k].tolist(), (r, ks.tolist())
            checked["drafts"] += k
        checked["steps"] += 1
        checked["mixed"] += len(set(ks.tolist())) > 1
        return got

    spec_obj._draft = checking_draft
    structured = eng.executor.worker.model_runner.structured
    out = run_to_completion(eng, PROMPTS, params)
    assert out == ref
    assert checked["mixed"] >= 5 and checked["drafts"] >= 20, checked
    if cfg == "chain_grammar":
        tok = AutoTokenizer.from_pretrained(llama_dir)
        for i in (0, 2):
            text = tok.decode(out[i], skip_special_tokens=True)
            assert re.fullmatch(DIGITS, text) and text, (out[i], text)
        # Each drafting row was masked with its own request's grammar: nothing forbidden was
        # drafted (a row mapped to another request's fork would draft letters here).
        assert structured.num_masked_draft_rows > 0
        assert structured.num_forbidden_drafts == 0
