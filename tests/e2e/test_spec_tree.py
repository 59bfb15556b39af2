# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft trees (speculative_token_tree) end to end: the text with a tree equals the text without
speculation, greedy and seeded, for EAGLE3 and EAGLE-1 heads that agree with the target never,
sometimes and always; the per-depth acceptance counters add up; a tree accepts more per step
than the chain of its first branch."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts
from vllm.testing.spec_checkpoints import (
    make_eagle3_draft,
    make_eagle_draft,
    make_llama_bigram_target,
)

LENGTHS = [40, 23, 57, 9, 3, 30]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=8, disable_log_stats=False)
# Forks at the root (3 children), the first branch 3 deep, a second-level fork.
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(512, LENGTHS, seed=5)


@pytest.fixture(scope="module")
def eagle3_dir(llama_dir, tmp_path_factory):
    return make_eagle3_draft(tmp_path_factory.mktemp("tree_eagle3"), llama_dir)


@pytest.fixture(scope="module")
def eagle_self_dir(llama_dir, tmp_path_factory):
    return make_eagle_draft(tmp_path_factory.mktemp("tree_eagle_self"), llama_dir, self_draft=True)


@pytest.fixture(scope="module")
def near_bigram_dir(llama_dir, tmp_path_factory):
    return make_llama_bigram_target(
        tmp_path_factory.mktemp("tree_near_bigram"), llama_dir, target_scale=0.7
    )


@pytest.fixture(scope="module")
def bigram_dir(llama_dir, tmp_path_factory):
    return make_llama_bigram_target(tmp_path_factory.mktemp("tree_bigram"), llama_dir)


def _run(model: str, prompts, sp, spec=None, **kw):
    llm = LLM(model=model, speculative_config=spec, **{**COMMON, **kw})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], {m.name: m for m in llm.get_metrics()}
    finally:
        llm.shutdown()


def _counts(metrics) -> tuple[int, int, list[int]]:
    return (
        int(metrics["vllm:spec_decode_num_drafts"].value),
        int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    )


def _tree_spec(method: str, draft: str, tree: str = TREE) -> dict:
    return {
        "method": method,
        "model": draft,
        "speculative_token_tree": tree,
        "adaptive_num_speculative_tokens": False,
    }


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_eagle3_tree_equals_no_speculation(llama_dir, eagle3_dir, prompts, sp):
    """A random EAGLE3 head: nearly every branch is wrong; the text must not change."""
    ref, _ = _run(llama_dir, prompts, sp)
    got, m = _run(llama_dir, prompts, sp, _tree_spec("eagle3", eagle3_dir))
    assert got == ref
    drafts, accepted, per_depth = _counts(m)
    assert drafts > 0 and sum(per_depth) == accepted


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_eagle_tree_sometimes_right(near_bigram_dir, eagle_self_dir, prompts, sp):
    """An EAGLE-1 head that agrees with the target part of the time: branches other than
    the first get accepted, paths end at every depth; the text is unchanged."""
    ref, _ = _run(near_bigram_dir, prompts, sp)
    got, m = _run(near_bigram_dir, prompts, sp, _tree_spec("eagle", eagle_self_dir))
    assert got == ref
    drafts, accepted, per_depth = _counts(m)
    assert sum(per_depth) == accepted and 0 < accepted
    assert all(a >= b for a, b in zip(per_depth, per_depth[1:])), per_depth
    assert not any(per_depth[3:])  # counters per depth: the tree is 3 deep


def test_deepest_branch_right(bigram_dir, eagle_self_dir, prompts):
    """A head that predicts the target exactly: every step accepts the deepest path (3
    drafts) and the text is unchanged."""
    ref, _ = _run(bigram_dir, prompts, GREEDY)
    got, m = _run(bigram_dir, prompts, GREEDY, _tree_spec("eagle", eagle_self_dir))
    assert got == ref
    drafts, accepted, per_depth = _counts(m)
    assert accepted == 3 * drafts, (drafts, accepted, per_depth)
