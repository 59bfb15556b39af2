# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Penalties, logit_bias, allowed_token_ids, bad_words, min_tokens with stop tokens and min_p
against a brute-force reference, with and without speculation, at P = 1 and 2.

The reference is HF transformers: a full forward over prompt + output for every token, the
adjustment of each control written out below (vLLM's order and definitions), then argmax
(greedy) or Gumbel-max with the keyed exponential noise (seeded; the noise is the definition of
a seeded draw). The controlled requests run batched with requests that use none of them, on
a Llama (EAGLE3 head), a DeepSeek-V3 (MTP) and a Qwen3.5 (MTP); each draft model agrees with
its target part of the time, so drafts are both accepted and rejected, and a draft accepted in
a step counts in the history (penalties, bad words, min_tokens) of the step's later positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing import qwen3_5_checkpoints as q35
from vllm.testing.engine_utils import hf_model, make_prompts, spec_decode_counts
from vllm.testing.spec_checkpoints import (
    make_eagle3_bigram_head,
    make_llama_bigram_target,
    make_mtp_self_draft,
)
from vllm.v1.worker.gpu.sample.sampler import exponential_noise

pytestmark = pytest.mark.usefixtures("pp_forkserver")

MAX_TOKENS = 16
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=10, disable_log_stats=False)
K = 2


# ---- the models --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_target(llama_dir, tmp_path_factory) -> str:
    return make_llama_bigram_target(
        tmp_path_factory.mktemp("lc_llama"), llama_dir, target_scale=0.3
    )


@pytest.fixture(scope="module")
def llama_eagle3(llama_target, tmp_path_factory) -> str:
    return make_eagle3_bigram_head(tmp_path_factory.mktemp("lc_e3"), llama_target)


@pytest.fixture(scope="module")
def dsv3_mtp(deepseek_v3_mtp1_dir, tmp_path_factory) -> str:
    return make_mtp_self_draft(
        tmp_path_factory.mktemp("lc_dsv3"), deepseek_v3_mtp1_dir, target_scale=0.2
    )


@pytest.fixture(scope="module")
def qwen3_5_mtp(tmp_path_factory) -> str:
    src = q35.make_qwen3_5(tmp_path_factory.mktemp("lc_q35_src"), mtp_num_hidden_layers=1)
    return q35.make_qwen3_5_mtp_self_draft(tmp_path_factory.mktemp("lc_q35"), src, target_scale=0.3)


MODELS = {"llama": "llama_target", "dsv3_mtp": "dsv3_mtp", "qwen3_5_mtp": "qwen3_5_mtp"}


def _spec(request, model: str) -> dict:
    if model == "llama":
        return {
            "method": "eagle3",
            "model": request.getfixturevalue("llama_eagle3"),
            "num_speculative_tokens": K,
            "adaptive_num_speculative_tokens": False,
        }
    return {"method": "mtp", "num_speculative_tokens": K, "adaptive_num_speculative_tokens": False}


# ---- the requests ------------------------------------------------------------------------------
def _requests(model_dir: str) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and params: four controlled requests between two plain ones."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(512, [13, 7, 21, 9, 17, 11, 8, 15, 10, 12], seed=31)
    # A bad word of two tokens and one of one token, taken from the vocabulary.
    two = tok.decode([300, 301])
    one = tok.decode([77]).strip() or "x"
    plain = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    sps = [
        SamplingParams(temperature=0, **plain),
        SamplingParams(
            temperature=0,
            repetition_penalty=1.6,
            frequency_penalty=0.7,
            presence_penalty=0.4,
            logprobs=2,
            **plain,
        ),
        SamplingParams(
            temperature=0.9,
            seed=7,
            min_p=0.05,
            frequency_penalty=1.2,
            allowed_token_ids=list(range(3, 400, 3)),
            logit_bias={9: 2.0, 12: -3.0},
            logprobs=0,
            **plain,
        ),
        SamplingParams(
            temperature=0,
            logit_bias={5: 1.5, 40: 2.5, 41: -100.0},
            bad_words=[two, one],
            repetition_penalty=0.8,  # < 1 rewards repeats
            **plain,
        ),
        # The biased stop token would come first; min_tokens holds it (and EOS) back.
        SamplingParams(
            temperature=0,
            min_tokens=6,
            stop_token_ids=[50],
            logit_bias={50: 8.0},
            max_tokens=MAX_TOKENS,
        ),
        SamplingParams(temperature=1.0, seed=11, **plain),
        # One control each, at strengths that keep the bigram loops these targets fall into
        # partly alive (so the drafts that continue a loop are accepted, and penalised later).
        SamplingParams(temperature=0, frequency_penalty=-1.5, **plain),
        SamplingParams(temperature=0, presence_penalty=0.5, **plain),
        SamplingParams(temperature=0, repetition_penalty=1.2, **plain),
        SamplingParams(temperature=0.7, seed=3, repetition_penalty=0.7, **plain),
    ]
    return prompts, sps


def _stop_ids(model_dir: str, sp: SamplingParams) -> set[int]:
    from transformers import AutoTokenizer

    ids = set(sp.stop_token_ids or ())
    if not sp.ignore_eos:
        ids.add(AutoTokenizer.from_pretrained(model_dir).eos_token_id)
        gen = Path(model_dir) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def _bad_words_ids(model_dir: str, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word stripped of leading spaces, and with one leading space when that
    gives a different first token and the same number of tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out: list[list[int]] = []
    for w in words:
        plain = tok.encode(w.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def reference(model_dir: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """One request by brute force: HF logits of the whole sequence for every new token."""
    return reference_with_logprobs(model_dir, prompt, sp)[0]


def reference_with_logprobs(
    model_dir: str, prompt: list[int], sp: SamplingParams
) -> tuple[list[int], list[float], list[float]]:
    """(tokens, the log-probability of each under the model's raw logits - vLLM's default
    logprobs_mode raw_logprobs -, and under the logits the sampler drew from: the controls,
    temperature and min-p applied - processed_logprobs)."""
    m = hf_model(model_dir)
    stop = _stop_ids(model_dir, sp)
    bad = _bad_words_ids(model_dir, sp.bad_words or [])
    out: list[int] = []
    lps: list[float] = []
    processed: list[float] = []
    while len(out) < (sp.max_tokens or MAX_TOKENS):
        with torch.no_grad():
            logits = m(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        raw = logits.clone()
        V = logits.shape[0]
        if sp.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[sp.allowed_token_ids] = True
            logits[~keep] = float("-inf")
        for ids in bad:
            if len(ids) == 1 or out[len(out) - len(ids) + 1 :] == ids[:-1]:
                logits[ids[-1]] = float("-inf")
        for t, b in (sp.logit_bias or {}).items():
            logits[t] += b
        if len(out) < sp.min_tokens:
            for t in stop:
                logits[t] = float("-inf")
        for t in range(V):
            n_out = out.count(t)
            if sp.repetition_penalty != 1.0 and (n_out or t in prompt):
                if logits[t] > 0:
                    logits[t] = logits[t] / sp.repetition_penalty
                else:
                    logits[t] = logits[t] * sp.repetition_penalty
            logits[t] -= sp.frequency_penalty * n_out + sp.presence_penalty * (n_out > 0)
        if sp.temperature == 0:
            t_new = int(logits.argmax())
            probs = logits.softmax(-1)
        else:
            probs = (logits / sp.temperature).softmax(-1)
            if sp.min_p:
                probs = torch.where(probs < sp.min_p * probs.max(), 0.0, probs)
                probs = probs / probs.sum()
            pos = len(prompt) + len(out)
            noise = exponential_noise(np.array([sp.seed]), np.array([pos]), V, torch.device("cpu"))
            t_new = int((probs / noise[0]).argmax())
        out.append(t_new)
        lps.append(float(raw.log_softmax(-1)[t_new]))
        processed.append(float(probs[t_new].log()))
        if t_new in stop:
            break
    return out, lps, processed


@pytest.fixture(scope="module")
def references(request) -> dict:
    cache: dict = {}

    def get(model: str):
        if model not in cache:
            path = request.getfixturevalue(MODELS[model])
            prompts, sps = _requests(path)
            cache[model] = [reference_with_logprobs(path, p, sp) for p, sp in zip(prompts, sps)]
        return cache[model]

    return get  # type: ignore[return-value]


def _generate(path: str, spec: dict | None, pp: int, **kw):
    prompts, sps = _requests(path)
    llm = LLM(model=path, speculative_config=spec, pipeline_parallel_size=pp, **COMMON, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        lps = [
            [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
            for o in outs
        ]
        return [list(o.outputs[0].token_ids) for o in outs], lps, spec_decode_counts(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("spec", ["nospec", "spec"])
@pytest.mark.parametrize("model", list(MODELS))
def test_controls_equal_brute_force_reference(request, references, model, spec, pp) -> None:
    path = request.getfixturevalue(MODELS[model])
    ref = references(model)
    got, lps, counts = _generate(path, _spec(request, model) if spec == "spec" else None, pp)
    for i, (g, (r, r_lps, _)) in enumerate(zip(got, ref)):
        assert g == r, f"request {i}: {g} != reference {r}"
        if _requests(path)[1][i].logprobs is not None:  # the target's raw logits (vLLM's)
            np.testing.assert_allclose(lps[i], r_lps, atol=1e-4, rtol=1e-4)
    if spec == "spec":
        drafted, accepted = counts[1], counts[2]
        assert 0 < accepted < drafted, counts  # drafts both accepted and rejected


def test_controls_change_the_output(request, references) -> None:
    """The controlled requests' references differ from plain greedy / seeded sampling (the
    controls bite, so the comparison above tests them), and the min_tokens request ends on a
    stop token after at least min_tokens tokens."""
    path = request.getfixturevalue("llama_target")
    prompts, sps = _requests(path)
    ref = [r for r, *_ in references("llama")]
    for i in (1, 2, 3, 4):
        sp = sps[i]
        plain = SamplingParams(
            temperature=sp.temperature, seed=sp.seed, max_tokens=sp.max_tokens, ignore_eos=True
        )
        assert ref[i] != reference(path, prompts[i], plain)[: len(ref[i])], i
    assert 6 <= len(ref[4]) < MAX_TOKENS and ref[4][-1] in _stop_ids(path, sps[4])


def test_processed_logprobs_mode(request, references) -> None:
    """logprobs_mode="processed_logprobs": the logprobs of the logits the sampler drew from
    (the controls, temperature and min-p applied), which differ from the default raw ones for
    the controlled requests; the tokens are the same."""
    path = request.getfixturevalue(MODELS["llama"])
    ref = references("llama")
    got, lps, _ = _generate(path, None, 1, logprobs_mode="processed_logprobs")
    checked = 0
    for i, (g, (r, raw, processed)) in enumerate(zip(got, ref)):
        assert g == r
        if _requests(path)[1][i].logprobs is not None:
            np.testing.assert_allclose(lps[i], processed, atol=1e-4, rtol=1e-4)
            checked += not np.allclose(raw, processed, atol=1e-3)
    assert checked, "no controlled request's processed logprobs differ from its raw ones"
