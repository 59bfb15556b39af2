# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""adaptive_draft_confidence end to end: SmolLM2-135M-Instruct with its bundled EAGLE3 head, an
adaptive chain of 3 (the default shape) and an adaptive dynamic tree of 8 nodes, held-out
prompts, 4 requests at once.

- lossless: greedy and seeded-sampling output equal no speculation's;
- the worker reports, per request, the running product of the draft's top probabilities -
  in (0, 1], never rising along a chain - and the scheduler's calibration learns from the
  drafts it verified;
- a floor (here forced high) stops a request's drafting after a draft whose successor could
  not pay: every reported chain continues only past drafts confident enough, some stop early,
  and the output still equals no speculation's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm import LLM, SamplingParams
from vllm.model_zoo import SMOLLM2_EAGLE3_DIR
from vllm.testing.engine_utils import record_draft_confidences
from vllm.v1.worker.gpu.spec_decode.autoregressive.confidence import CONTINUE_RATE

pytestmark = pytest.mark.slow

NUM_PROMPTS, MAX_TOKENS = 4, 32
FORCED_FLOOR = 0.45  # a next draft expected below this does not pay its row (forced)


def _chats() -> list[list[dict[str, str]]]:
    prompts = json.loads((Path(SMOLLM2_EAGLE3_DIR) / "heldout_prompts.json").read_text())
    return [[{"role": "user", "content": p}] for p in prompts[:NUM_PROMPTS]]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
]


def _run(model: str, spec: dict | None, floor: float | None = None) -> dict:
    llm = LLM(
        model=model, dtype="float32", max_model_len=512, max_num_seqs=4, speculative_config=spec
    )
    reports: list[list[float]] = []
    try:
        eng = llm.llm_engine
        if spec is not None:
            reports = record_draft_confidences(llm, floor)
            conf = eng.scheduler.spec_k.confidence
        outs = [
            [list(o.outputs[0].token_ids) for o in llm.chat(_chats(), sp, use_tqdm=False)]
            for sp in PARAMS
        ]
        res = {"outs": outs, "reports": reports}
        if spec is not None:
            res["seen"] = sum(conf.greedy.seen) + sum(conf.sampled.seen)
            res["stopped"] = eng.executor.worker.model_runner.speculator.confidence.num_stopped
        return res
    finally:
        llm.shutdown()


SPEC = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR), "num_speculative_tokens": 3}
TREE = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR), "num_tree_nodes": 8}


@pytest.fixture(scope="module")
def runs(smollm2_dir):
    return {
        "none": _run(smollm2_dir, None),
        "conf": _run(smollm2_dir, SPEC),
        "floor": _run(smollm2_dir, SPEC, FORCED_FLOOR),
        "tree": _run(smollm2_dir, TREE),
    }


def test_output_equals_no_speculation(runs):
    for name in ("conf", "floor", "tree"):
        assert runs[name]["outs"] == runs["none"]["outs"], name


@pytest.mark.parametrize("name", ["conf", "tree"])
def test_confidences_are_reported_and_learned_from(runs, name):
    """A chain's running products, a dynamic tree's path probabilities (most probable node
    first): in (0, 1], never rising."""
    reports = runs[name]["reports"]
    assert len(reports) > 20
    for chain in reports:
        assert all(0.0 < c <= 1.0 + 1e-6 for c in chain)
        assert all(b <= a + 1e-6 for a, b in zip(chain, chain[1:]))
    assert runs[name]["seen"] > 20


def test_a_floor_stops_drafting_after_unconfident_drafts(runs):
    reports = runs["floor"]["reports"]
    assert runs["floor"]["stopped"] > 0
    assert any(len(chain) == 1 for chain in reports)
    for chain in reports:
        # Draft j + 1 was drafted only if draft j's successor was expected to pay its row.
        assert all(c * CONTINUE_RATE >= FORCED_FLOOR for c in chain[:-1]), chain
