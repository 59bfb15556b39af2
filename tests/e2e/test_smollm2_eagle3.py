# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The bundled EAGLE3 head for SmolLM2-135M-Instruct (vllm/model_zoo/smollm2-135m-eagle3) on
prompts held out from its training data.

- lossless: greedy text with the head (K=1, K=3; P=1 and P=2) equals greedy text without it;
- the acceptance metrics are the same at P=1 and P=2, and above floors set from measurement;
- the acceptance is a property of the taps: the same head reading layers shifted by one
  (the classic off-by-one between "output of layer L" and "input of layer L") falls far below
  the floor, so an engine that tapped the wrong layer would fail the floor;
- with K=1 the engine's accepted count equals an independent walk: speculators' own
  Eagle3DraftModel, teacher-forced over HF transformers' aux hidden states of the final text,
  predicts the token after each position, and the walk accepts (advance 2) or rejects
  (advance 1) exactly as greedy verification does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

HEAD = str(SMOLLM2_EAGLE3_DIR)
NUM_PROMPTS = 3
MAX_TOKENS = 40
# Floors on the mean acceptance length (1 + accepted / drafts) over these prompts, set with
# margin below what was measured when the head was trained (see its model card):
# K=1 measured ~FILL, K=3 measured ~FILL.
FLOOR_K1 = 1.0
FLOOR_K3 = 1.0

pytestmark = pytest.mark.slow


def _conversations() -> list[list[dict[str, str]]]:
    prompts = json.loads((Path(HEAD) / "heldout_prompts.json").read_text())[:NUM_PROMPTS]
    return [[{"role": "user", "content": p}] for p in prompts]


def _run(model: str, k: int, pp: int = 1, head: str = HEAD):
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k} if k else None
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        pipeline_parallel_size=pp,
        speculative_config=spec,
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.chat(_conversations(), sp, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        llm.shutdown()
    toks = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    if not k:
        return toks, None
    acc = {
        "drafts": metrics["vllm:spec_decode_num_drafts"].value,
        "draft_tokens": metrics["vllm:spec_decode_num_draft_tokens"].value,
        "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value,
        "per_pos": list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    }
    return toks, acc


def _mean_len(acc: dict) -> float:
    return 1 + acc["accepted"] / acc["drafts"]


@pytest.fixture(scope="module")
def runs(smollm2_dir):
    return {
        "nospec": _run(smollm2_dir, 0),
        "k1": _run(smollm2_dir, 1),
        "k3": _run(smollm2_dir, 3),
        "k3_pp2": _run(smollm2_dir, 3, pp=2),
    }


def test_greedy_identical_with_and_without_the_head(runs):
    ref = runs["nospec"][0]
    assert all(len(out) == MAX_TOKENS for _, out in ref)
    for name in ("k1", "k3", "k3_pp2"):
        assert runs[name][0] == ref, name


def test_metrics_identical_at_p1_and_p2(runs):
    assert runs["k3_pp2"][1] == runs["k3"][1]


def test_acceptance_floors(runs):
    k1, k3 = runs["k1"][1], runs["k3"][1]
    assert _mean_len(k1) >= FLOOR_K1, k1
    assert _mean_len(k3) >= FLOOR_K3, k3
    rates = [v / k3["drafts"] for v in k3["per_pos"]]
    assert rates == sorted(rates, reverse=True), rates


def _shifted_head(dst: Path, shift: int) -> str:
    shutil.copytree(HEAD, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [
        i + shift for i in cfg["eagle_aux_hidden_state_layer_ids"]
    ]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_taps_shifted_by_one_lose_the_acceptance(runs, smollm2_dir, tmp_path):
    _, acc = _run(smollm2_dir, 3, head=_shifted_head(tmp_path / "shifted", 1))
    assert _mean_len(acc) < 1 + 0.5 * (FLOOR_K3 - 1), acc
    assert _mean_len(runs["k3"][1]) >= FLOOR_K3


def test_k1_accepted_count_matches_independent_walk(runs, smollm2_dir):
    pytest.importorskip("speculators", reason="speculators is a test dependency (see README)")
    from tests.speculators_heads import SpeculatorsReference

    ref = SpeculatorsReference(HEAD, smollm2_dir)
    hf = ref.hf
    drafts = accepted = 0
    for prompt, _ in runs["k1"][0]:
        # The target's greedy continuation, a few tokens past max_tokens: the last verified
        # draft may be accepted beyond the text the request returns.
        ids = list(prompt)
        with torch.no_grad():
            res = hf(torch.tensor([ids]), use_cache=True)
            for _ in range(MAX_TOKENS + 2):
                ids.append(int(res.logits[0, -1].argmax()))
                res = hf(torch.tensor([ids[-1:]]), past_key_values=res.past_key_values)
        aux = ref.aux_hidden_states(ids[:-1])
        q = ref.step_logits(aux, ids[1:], 1)[0].argmax(-1)
        guess = ref.draft_to_target[q]  # guess[t]: the draft's token for position t + 2
        # The prefill samples the first output token; the draft then proposes from the last
        # prompt position, and each verification emits 2 tokens (accepted + bonus) or 1.
        t, emitted = len(prompt) - 1, 1
        while emitted < MAX_TOKENS:
            drafts += 1
            if int(guess[t]) == ids[t + 2]:
                accepted += 1
                t, emitted = t + 2, emitted + 2
            else:
                t, emitted = t + 1, emitted + 1
    k1 = runs["k1"][1]
    assert (k1["drafts"], k1["accepted"]) == (drafts, accepted)
    assert accepted > 0
