# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The bundled default model (a trained tiny DeepSeek-V3 with 2 real MTP heads): speculation is
lossless, acceptance is real (above a measured floor), and P = 2 drafts, accepts and emits
exactly what P = 1 does. A drafter with a wrong embedding table under P = 2 (the target's is
absent on the last stage) would pass the losslessness checks but fail the acceptance ones here."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.config import default_model_path

# Held-out prompts (written for this test, not taken from the training corpus).
PROMPTS = [
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n",
    "for key, value in sorted(counts.items()):\n",
]
MAX_TOKENS = 32
# Mean acceptance length floors, set with margin below what was measured (see the closing
# note of the issue and benchmarks/RESULTS.md for the measured values).
FLOOR = {1: 1.45, 2: 1.6}


def _spec_metrics(llm: LLM) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def _run(pp: int, k: int):
    spec = (
        {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": k}
        if k
        else None
    )
    return _generate(spec, pipeline_parallel_size=pp)


def _generate(spec: dict | None, **par):
    """Greedy outputs of PROMPTS and the spec-decode counters."""
    llm = LLM(speculative_config=spec, max_model_len=512, **par)
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], _spec_metrics(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def no_spec():
    return _run(1, 0)[0]


def test_bundled_model_is_the_default():
    llm = LLM(max_model_len=128)
    try:
        assert llm.llm_engine.model_config.model == default_model_path()
        cfg = llm.llm_engine.model_config.hf_config
        assert cfg.architectures == ["DeepseekV3ForCausalLM"]
        assert cfg.num_nextn_predict_layers == 2
    finally:
        llm.shutdown()


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_lossless_real_acceptance_and_pp2_identical(no_spec, k):
    tokens1, m1 = _run(1, k)
    assert tokens1 == no_spec
    drafts = m1["vllm:spec_decode_num_drafts"]
    accepted = m1["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0
    mean_len = 1 + accepted / drafts
    print(
        f"K={k}: mean acceptance length {mean_len:.3f}, per position "
        f"{[v / drafts for v in m1['vllm:spec_decode_num_accepted_tokens_per_pos']]}"
    )
    assert mean_len >= FLOOR[k]
    tokens2, m2 = _run(2, k)
    assert tokens2 == no_spec
    assert m2 == m1


# Forks at the root, the first branch three deep.
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
TREES = {
    "static": {"speculative_token_tree": TREE},
    "dynamic": {"num_tree_nodes": 6, "tree_top_k": 2, "tree_max_depth": 4},
}


def _tree_run(tree: str, **par):
    return _generate(
        {"method": "mtp", "adaptive_num_speculative_tokens": False, **TREES[tree]}, **par
    )


@pytest.mark.usefixtures("pp_forkserver")
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_mtp_tree_greedy_identical_at_p1_p2_p4_and_tp2(no_spec, tree):
    """A draft tree on the bundled model (two MTP layers: the tree drafts every depth with the
    first) emits no speculation's greedy text at P = 1, 2, 4 and TP = 2, accepting paths past
    the first node; every layout drafts and accepts exactly what P = 1 does."""
    tokens1, m1 = _tree_run(tree)
    assert tokens1 == no_spec
    per_depth = m1["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_depth[0] > 0 and per_depth[1] > 0 and per_depth[2] > 0, per_depth
    for par in (
        dict(pipeline_parallel_size=2),
        dict(pipeline_parallel_size=4),
        dict(tensor_parallel_size=2),
    ):
        tokens, m = _tree_run(tree, **par)
        assert tokens == no_spec, par
        assert m == m1, par


@pytest.mark.parametrize(
    "max_model_len,spec,match",
    [
        (512, None, r"max_model_len \(512 tokens\) needs 128 KV cache blocks of 4 tokens"),
        (
            160,
            {"method": "mtp", "num_speculative_tokens": 2},
            r"max_model_len \(160 tokens \+ 2 draft tokens\) needs 41 KV cache blocks",
        ),
    ],
)
def test_a_kv_cache_smaller_than_max_model_len_is_refused(max_model_len, spec, match):
    """A 40-block pool of 4-token blocks cannot hold one request of max_model_len tokens (plus
    the drafts' lookahead): refused at start-up with both numbers and the flags that change
    them, as vLLM does, instead of admitting requests that would wait for blocks forever."""
    with pytest.raises(ValueError, match=match) as err:
        LLM(
            block_size=4,
            max_num_batched_tokens=16,
            num_gpu_blocks_override=40,
            max_model_len=max_model_len,
            speculative_config=spec,
        )
    assert "holds only 40 blocks (160 tokens)" in str(err.value)
    assert "--max-model-len" in str(err.value) and "--kv-cache-memory-bytes" in str(err.value)


def test_a_tree_drafts_with_the_first_mtp_layer_only():
    """The second MTP layer reads the first's output at its own position, one row per
    position; a tree has several rows per position, so it never runs under a tree."""
    spec = {"method": "mtp", "adaptive_num_speculative_tokens": False, **TREES["static"]}
    llm = LLM(speculative_config=spec, max_model_len=512)
    try:
        draft = llm.llm_engine.executor.worker.model_runner.speculator.model
        calls = [0, 0]
        for i in (0, 1):
            layer = draft.model.layer_for_step(i)
            layer.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls[0] > 0 and calls[1] == 0, calls


def test_a_chain_longer_than_the_mtp_layers_under_a_small_token_budget():
    """K = 3 drafts from 2 MTP layers (the third reuses the first), 8 requests and a 32-token
    budget: some requests verify fewer drafts than others in a step, so a draft step meets rows
    the step before did not compute - past the chained layers there is no carried row to read
    (an IndexError before the fix, found by tools/spec_fuzz.py). Greedy equals no speculation."""
    from vllm.testing.engine_utils import make_prompts

    prompts = [{"prompt_token_ids": p} for p in make_prompts(2048, [31, 56, 12, 7, 10, 14, 56, 35])]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        if spec is not None:
            spec["adaptive_num_speculative_tokens"] = False
        llm = LLM(
            speculative_config=spec, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=32
        )
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
            counts = _spec_metrics(llm)
        finally:
            llm.shutdown()
    assert outs[1] == outs[0]
    assert counts["vllm:spec_decode_num_accepted_tokens"] > 0
