# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DFlash / DSpark heads against speculators' own draft models, and their config checks.

The heads are random, built and saved by the speculators library itself. The engine drafts for
real requests (greedy; its output must equal the target's without speculation); for every
block it drafted we record the anchor position, the drafts and the logits of each drafted slot,
and speculators' anchored-block forward - one anchor at the end of that context, over HF
transformers' aux hidden states, DSpark's Markov bias fed the drafted tokens as the block's
previous tokens - must give the same logits (and DSpark the same confidence estimates).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.checkpoints import copy_checkpoint
from vllm.testing.engine_utils import make_prompts
from vllm.testing.speculators_dflash_heads import DFlashReference, make_speculators_dflash

pytest.importorskip("speculators", reason="speculators is a test dependency (see README)")

COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

HEADS = {
    # name: make_speculators_dflash kwargs
    "dflash": dict(block_size=4),
    "dflash-anchor-d2t-2layers": dict(
        block_size=3, sample_from_anchor=True, draft_vocab_size=300, num_layers=2, seed=1
    ),
    "dspark-vanilla": dict(dspark=True, block_size=3, markov_head_type="vanilla", seed=2),
    "dspark-gated-d2t": dict(
        dspark=True, block_size=4, markov_head_type="gated", draft_vocab_size=256, seed=3
    ),
    "dspark-rnn-no-anchor": dict(
        dspark=True, block_size=4, markov_head_type="rnn", sample_from_anchor=False, seed=4
    ),
    "dspark-no-markov": dict(
        dspark=True, block_size=3, markov_rank=0, confidence_head_with_markov=False, seed=5
    ),
}
# Engine settings of some cases (target "llama" unless named): prompts prefilled in chunks of
# 8 tokens (the context of a block spans chunks written in earlier steps), a repeated prompt
# whose first KV block is a prefix-cache hit (its draft context keys / values come from the
# other request's writes), and a Qwen2 target (qkv biases) whose taps feed the context.
ENGINE = {
    "dflash-chunked": ("dflash", dict(max_num_batched_tokens=8)),
    "dspark-rnn-prefix-hit": (
        "dspark-rnn-no-anchor",
        dict(repeat_prompt=True, enable_prefix_caching=True, disable_log_stats=False),
    ),
    "dspark-gated-d2t-qwen2": ("dspark-gated-d2t", dict(target="qwen2")),
}


def _runner(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner


def _record(llm: LLM) -> list[tuple[str, int, list[int], list[torch.Tensor], list[float]]]:
    """(request id, anchor position, drafts, logits row per drafted slot, confidences) of
    every block drafted after a sampled token."""
    spec = _runner(llm).speculator
    orig = spec.propose
    records = []

    def propose(inputs):
        drafts = orig(inputs)
        for i, rid in enumerate(inputs.input_batch.req_ids):
            if inputs.step.num_sampled[i]:
                records.append(
                    (
                        rid,
                        int(spec.last_anchor_pos[i]),
                        [int(t) for t in drafts[i]],
                        [x[i].clone() for x in spec.last_logits],
                        [float(c[i]) for c in spec.last_confidence],
                    )
                )
        return drafts

    spec.propose = propose
    return records


@pytest.fixture(scope="module")
def no_spec():
    """target folder -> (prompts, greedy tokens without speculation), each computed once."""
    cache: dict[str, tuple] = {}

    def get(target: str) -> tuple:
        if target not in cache:
            prompts = make_prompts(512, [9, 17, 20], seed=3)
            llm = LLM(model=target, **COMMON)
            try:
                params = [{"prompt_token_ids": p} for p in prompts]
                outs = llm.generate(params, GREEDY, use_tqdm=False)
                cache[target] = (prompts, [list(o.outputs[0].token_ids) for o in outs])
            finally:
                llm.shutdown()
        return cache[target]

    return get


@pytest.mark.parametrize("name", list(HEADS) + list(ENGINE))
def test_block_logits_match_speculators(name, llama_dir, qwen2_dir, no_spec, tmp_path, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator

    # The confidence head's estimates are logged every CONFIDENCE_LOG_INTERVAL proposals.
    monkeypatch.setattr(dflash_speculator, "CONFIDENCE_LOG_INTERVAL", 1)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    dflash_speculator.logger.addHandler(handler)
    try:
        head_name, kw = ENGINE.get(name, (name, {}))
        kw = dict(kw)
        target = qwen2_dir if kw.pop("target", "llama") == "qwen2" else llama_dir
        _check_block_logits(head_name, kw, target, no_spec(target), tmp_path, logged)
    finally:
        dflash_speculator.logger.removeHandler(handler)


def _check_block_logits(head_name, kw, target, no_spec, tmp_path, logged) -> None:
    prompts, ref_tokens = no_spec
    repeated = kw.pop("repeat_prompt", False)
    if repeated:
        prompts, ref_tokens = prompts + prompts[2:], ref_tokens + ref_tokens[2:]
    head = make_speculators_dflash(tmp_path / head_name, target, **HEADS[head_name])
    llm = LLM(
        model=target,
        speculative_config={"model": head, "adaptive_num_speculative_tokens": False},
        **{**COMMON, **kw},
    )
    try:
        records = _record(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        req_ids = [o.request_id for o in outs]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        confidence = _runner(llm).speculator.confidence_stats()
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        llm.shutdown()
    assert tokens == ref_tokens
    assert records, "the drafter never fired"
    if repeated:
        assert metrics["vllm:prefix_cache_hits"].value >= 16
    ref = DFlashReference(head, target)
    first = 0 if ref.sample_from_anchor else 1
    seqs = {r: p + t for r, p, t in zip(req_ids, prompts, tokens)}
    checked = 0
    for rid, a, drafts, rows, confs in records:
        if a >= len(seqs[rid]):
            continue  # anchored on a token the request never kept (it finished)
        want = ref.block_logits(seqs[rid][: a + 1], drafts)
        for k, row in enumerate(rows):
            torch.testing.assert_close(row, want[first + k], atol=2e-4, rtol=1e-4)
            assert int(ref.draft_to_target[int(row.argmax())]) == drafts[k]
        if ref.dspark and ref.confidence is not None:
            got = torch.tensor(confs)
            torch.testing.assert_close(got, ref.confidence[first : first + len(confs)].float())
        checked += 1
    assert checked >= 4
    has_conf = ref.dspark and ref.model.confidence_head is not None
    assert (confidence is not None) == has_conf
    lines = [r.getMessage() for r in logged if "DSpark confidence head" in r.getMessage()]
    assert bool(lines) == has_conf
    if has_conf:
        assert len(confidence) == len(records[0][2]) and ((confidence > 0) & (confidence < 1)).all()
        assert str(round(float(confidence[0]), 3)) in lines[-1]


# ---------------------------------------------------------------------------- bad configs


@pytest.fixture(scope="module")
def dspark_dir(llama_dir, tmp_path_factory) -> str:
    return make_speculators_dflash(
        tmp_path_factory.mktemp("dspark_cfg"), llama_dir, dspark=True, block_size=4
    )


def _edited(src: str, dst: Path, **changes) -> str:
    """A copy of src with config.json fields set (None: deleted)."""
    drop = tuple(k for k, v in changes.items() if v is None)
    return copy_checkpoint(src, dst, {k: v for k, v in changes.items() if v is not None}, drop)


@pytest.mark.parametrize(
    "changes,spec,match",
    [
        (dict(markov_head_type="lstm"), {}, "markov_head_type 'lstm' is not supported"),
        (dict(aux_hidden_state_layer_ids=None), {}, "aux_hidden_state_layer_ids"),
        (dict(mask_token_id=None), {}, "mask_token_id is required"),
        (dict(mask_token_id=9999), {}, "mask_token_id must be an integer"),
        ({}, {"num_speculative_tokens": 5}, "num_speculative_tokens=5 does not fit"),
        ({}, {"method": "dflash"}, "does not match"),
        (dict(block_size=0), {}, "block_size must be an integer"),
        (dict(aux_hidden_state_layer_ids=[1, 2, 9]), {}, r"layer\(s\) \[9\] outside"),
    ],
)
def test_bad_dflash_configs(dspark_dir, llama_dir, tmp_path, changes, spec, match):
    head = _edited(dspark_dir, tmp_path / "head", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(model=llama_dir, speculative_config={"model": head, **spec}, **COMMON)


def test_block_size_bounds_k_without_anchor_sampling(llama_dir, tmp_path):
    """sample_from_anchor false: the anchor's slot drafts nothing, so block_size 4 holds at
    most 3 drafts; the checkpoint's own K (3) is the default."""
    head = make_speculators_dflash(tmp_path / "h", llama_dir, block_size=4)
    with pytest.raises(ValueError, match="at most 3 draft tokens"):
        LLM(model=llama_dir, speculative_config={"model": head, "num_speculative_tokens": 4})
    from vllm.config import SpeculativeConfig

    assert SpeculativeConfig.from_dict({"model": head}).num_speculative_tokens == 3
    assert SpeculativeConfig.from_dict({"model": head}).method == "dflash"


def test_native_dflash_taps_shift_by_one():
    """A native DFlash config names the OUTPUT of target layer i (dflash_config
    .target_layer_ids); the engine taps the stream entering layer i + 1."""
    from types import SimpleNamespace

    from vllm.config.draft import get_eagle3_aux_layers_from_config, verify_dflash_draft

    cfg = SimpleNamespace(
        architectures=["DFlashDraftModel"],
        block_size=8,
        dflash_config={"mask_token_id": 7, "target_layer_ids": [0, 2, 5]},
    )
    verify_dflash_draft(cfg, "dflash", 7, SimpleNamespace(vocab_size=100), "native")
    assert get_eagle3_aux_layers_from_config(cfg) == (1, 3, 6)
    cfg.dflash_config = {"mask_token_id": 7}
    del cfg.eagle_config
    with pytest.raises(ValueError, match="names no target layers"):
        verify_dflash_draft(cfg, "dflash", 7, SimpleNamespace(vocab_size=100), "native")
