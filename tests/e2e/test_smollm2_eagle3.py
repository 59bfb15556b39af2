# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The bundled EAGLE3 head for SmolLM2-135M-Instruct (vllm/model_zoo/smollm2-135m-eagle3) on
prompts held out from its training data.

- lossless: greedy text with the head (K=1, K=3; P=1 and P=2) equals greedy text without it;
- the acceptance metrics are the same at P=1 and P=2, and above floors set from measurement;
- the taps: the engine's step-0 draft logits equal speculators' own Eagle3DraftModel over HF
  transformers' aux hidden states of the same text, and the same head reading layers shifted by
  one (the classic off-by-one between "output of layer L" and "input of layer L") breaks that
  equality far beyond the tolerance - the check an engine tapping the wrong layer would fail
  (the head's acceptance alone barely notices: neighbouring residual streams are similar);
- with K=1 the engine's accepted count equals an independent walk: speculators' forward,
  teacher-forced over HF's aux hidden states of the final text, predicts the token after each
  position, and the walk accepts (advance 2) or rejects (advance 1) exactly as greedy
  verification does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_zoo import SMOLLM2_EAGLE3_DIR
from vllm.testing.checkpoints import copy_checkpoint

HEAD = str(SMOLLM2_EAGLE3_DIR)
NUM_PROMPTS = 3
MAX_TOKENS = 40
# Floors on the mean acceptance length (1 + accepted / drafts) over these prompts, below what was
# measured on them with the shipped head (fp32, 3 held-out prompts x 40 tokens, greedy,
# deterministic): K=1 1.56 (42 of 75 drafts accepted), K=3 2.02 (59 of 174 draft tokens; per
# position 32, 17, 10 of 58). Three prompts are a small sample: the head before it measured
# 1.65 / 2.16 here but less on all 43 held-out prompts (the card's table: K=3 2.02 vs 2.12);
# the first head (640 training sequences) 1.42 / 1.76. A path that feeds the head the wrong
# hidden states is caught by the logit test below (the shipped head with its taps shifted by
# one still measured 1.95 here at K=3).
FLOOR_K1 = 1.50
FLOOR_K3 = 1.95
# Engine vs speculators draft logits (fp32; the head's weights are bf16 values in both):
# measured 2e-5; with the taps shifted by one, 3.4.
ATOL = 2e-3

pytestmark = pytest.mark.slow


def _conversations(n: int = NUM_PROMPTS) -> list[list[dict[str, str]]]:
    prompts = json.loads((Path(HEAD) / "heldout_prompts.json").read_text())[:n]
    return [[{"role": "user", "content": p}] for p in prompts]


def _run(
    model: str,
    k: int,
    pp: int = 1,
    head: str = HEAD,
    record: bool = False,
    num_prompts: int = NUM_PROMPTS,
    max_tokens: int = MAX_TOKENS,
):
    from vllm.testing.speculators_heads import record_drafts

    spec = (
        {
            "method": "eagle3",
            "model": head,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens": k,
        }
        if k
        else None
    )
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        pipeline_parallel_size=pp,
        speculative_config=spec,
    )
    try:
        records = record_drafts(llm) if record else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.chat(_conversations(num_prompts), sp, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        llm.shutdown()
    toks = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    acc = None
    if k:
        acc = {
            "drafts": metrics["vllm:spec_decode_num_drafts"].value,
            "draft_tokens": metrics["vllm:spec_decode_num_draft_tokens"].value,
            "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value,
            "per_pos": list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
        }
    return toks, acc, records


def _mean_len(acc: dict) -> float:
    return 1 + acc["accepted"] / acc["drafts"]


@pytest.fixture(scope="module")
def runs(smollm2_dir):
    return {
        "nospec": _run(smollm2_dir, 0),
        "k1": _run(smollm2_dir, 1, record=True),
        "k3": _run(smollm2_dir, 3),
        "k3_pp2": _run(smollm2_dir, 3, pp=2),
    }


@pytest.fixture(scope="module")
def reference(runs, smollm2_dir):
    """Per prompt: (the target's greedy text a few tokens past max_tokens, speculators' step-0
    draft logits [T, Vd] teacher-forced over it, and the reference itself)."""
    pytest.importorskip("speculators", reason="speculators is a test dependency (see README)")
    from vllm.testing.speculators_heads import SpeculatorsReference

    ref = SpeculatorsReference(HEAD, smollm2_dir)
    out = []
    for prompt, _ in runs["nospec"][0]:
        # The last verified draft may be accepted beyond the text the request returns.
        ids = list(prompt)
        with torch.no_grad():
            res = ref.hf(torch.tensor([ids]), use_cache=True)
            for _ in range(MAX_TOKENS + 2):
                ids.append(int(res.logits[0, -1].argmax()))
                res = ref.hf(torch.tensor([ids[-1:]]), past_key_values=res.past_key_values)
        # Row t reads the taps at t and the token at t + 1: it drafts the token at t + 2.
        logits = ref.step_logits(ref.aux_hidden_states(ids[:-1]), ids[1:], 1)[0]
        out.append((ids, logits))
    return ref, out


def test_greedy_identical_with_and_without_the_head(runs):
    ref = runs["nospec"][0]
    assert all(len(out) == MAX_TOKENS for _, out in ref)
    for name in ("k1", "k3", "k3_pp2"):
        assert runs[name][0] == ref, name


def test_metrics_identical_at_p1_and_p2(runs):
    assert runs["k3_pp2"][1] == runs["k3"][1]
    assert runs["k3"][1]["accepted"] > 0


def test_acceptance_floors(runs):
    k1, k3 = runs["k1"][1], runs["k3"][1]
    assert _mean_len(k1) >= FLOOR_K1, k1
    assert _mean_len(k3) >= FLOOR_K3, k3
    rates = [v / k3["drafts"] for v in k3["per_pos"]]
    assert rates == sorted(rates, reverse=True), rates


def _max_logit_error(records, reference) -> float:
    """Largest |engine - speculators| over every recorded step-0 draft logits row."""
    worst = 0.0
    for ctx, _, rows in records:
        matches = [(ids, lg) for ids, lg in reference if ids[: len(ctx)] == ctx]
        assert len(matches) == 1, "a proposal's context is no prefix of the greedy text"
        ids, logits = matches[0]
        worst = max(worst, float((rows[0] - logits[len(ctx) - 2]).abs().max()))
    return worst


def _shifted_head(dst: Path, shift: int) -> str:
    layers = json.loads((Path(HEAD) / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"
    ]
    return copy_checkpoint(
        HEAD, dst, {"eagle_aux_hidden_state_layer_ids": [i + shift for i in layers]}
    )


def test_draft_logits_match_speculators_and_shifted_taps_do_not(
    runs, reference, smollm2_dir, tmp_path
):
    _, ref_rows = reference
    records = runs["k1"][2]
    assert len(records) >= NUM_PROMPTS * MAX_TOKENS // 2
    assert _max_logit_error(records, ref_rows) <= ATOL
    # The engine reading the layers after the configured ones (a few proposals suffice).
    head = _shifted_head(tmp_path / "h", 1)
    shifted = _run(smollm2_dir, 1, head=head, record=True, num_prompts=1, max_tokens=4)
    assert _max_logit_error(shifted[2], ref_rows[:1]) > 100 * ATOL


def test_k1_accepted_count_matches_independent_walk(runs, reference):
    ref, rows = reference
    drafts = accepted = 0
    for (prompt, _), (ids, logits) in zip(runs["k1"][0], rows):
        guess = ref.draft_to_target[logits.argmax(-1)]  # guess[t]: the draft for t + 2
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


def test_head_loads_in_speculators_with_its_own_weights(reference):
    """speculators' Eagle3DraftModel.from_pretrained reads the shipped folder: the config it
    parses and the weights it holds are the file's (nothing left at random init)."""
    from safetensors import safe_open

    model = reference[0].model
    cfg = json.loads((Path(HEAD) / "config.json").read_text())
    assert model.draft_vocab_size == cfg["draft_vocab_size"]
    assert (
        list(model.config.eagle_aux_hidden_state_layer_ids)
        == (cfg["eagle_aux_hidden_state_layer_ids"])
    )
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    with safe_open(str(Path(HEAD) / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "fc.weight" in keys and "d2t" in keys
        for key in keys:
            torch.testing.assert_close(params[key].float(), f.get_tensor(key).float(), msg=key)
