# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Helpers shared by engine tests: HF transformers references and small prompt sets."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """HF transformers greedy continuation, never stopping early (a plain argmax loop over
    the HF model with its KV cache: `generate` would suppress EOS under min_new_tokens)."""
    m = hf_model(model_dir)
    out: list[int] = []
    with torch.no_grad():
        res = m(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_tokens):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = m(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] log-softmax of HF logits at every position."""
    m = hf_model(model_dir)
    with torch.no_grad():
        logits = m(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


def full_dist(entry: dict) -> torch.Tensor:
    """A logprobs entry that holds every token (logprobs=-1) as a [V] tensor, in token order."""
    return torch.tensor([entry[i].logprob for i in sorted(entry)])


def assert_logprobs_match_hf(model_dir: str, out, prompt: list[int]) -> torch.Tensor:
    """One RequestOutput generated with logprobs=-1, prompt_logprobs=-1 (greedy): every prompt
    and decode distribution equals HF's at the same position, and each generated token ranks
    first. Returns HF's [len(prompt) + len(gen), V] log-probs."""
    gen = list(out.outputs[0].token_ids)
    ref = hf_logprobs(model_dir, prompt + gen)
    vocab = ref.shape[-1]
    # Prompt: entry p (p >= 1) is the distribution at position p - 1.
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        ours = full_dist(out.prompt_logprobs[p])
        assert ours.shape[0] == vocab
        torch.testing.assert_close(ours, ref[p - 1], atol=2e-4, rtol=1e-4)
    # Decode: generated token j is sampled from the distribution at position len(prompt)-1+j.
    for j, entry in enumerate(out.outputs[0].logprobs):
        torch.testing.assert_close(full_dist(entry), ref[len(prompt) - 1 + j], atol=2e-4, rtol=1e-4)
        assert entry[gen[j]].rank == 1
    return ref


def run_to_completion(engine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Add one request per (prompt ids, sampling params) to an LLMEngine, step it until every
    request finished, shut it down; the output token ids in prompt order."""
    out: dict[str, list[int]] = {}
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        engine.shutdown()
    return [out[str(i)] for i in range(len(prompts))]


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]


def resume_and_kill(procs: list) -> None:
    """Teardown of a test that stopped (SIGSTOP) processes it started: continue and kill any
    still there, so none is left behind whatever the test's outcome."""
    import signal

    import psutil

    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            pass


SPEC_DECODE_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def spec_decode_counts(llm) -> tuple:
    """(drafts, draft tokens, accepted, per-position accepted) of an LLM's metrics (zeros
    when it never speculated)."""
    m = {x.name: x for x in llm.get_metrics()}
    if SPEC_DECODE_METRICS[0] not in m:
        return (0, 0, 0, [])
    per_pos = list(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values)
    return tuple(m[n].value for n in SPEC_DECODE_METRICS) + (per_pos,)


def simulate_spec_decode(
    ref: list[list[int]], propose: Callable[[int], list[int]], k: int, max_tokens: int
) -> tuple:
    """(drafts, draft tokens, accepted, accepted per position) of greedy speculative decoding
    over the greedy outputs ref (each at least max_tokens + k + 1 long) by a drafter whose K
    drafts depend only on the last token (propose(anchor)): every step verifies them from the
    last token, accepting the longest matching prefix plus one. What spec_decode_counts must
    report for such a drafter."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    for out in ref:
        n = 1  # the prefill samples the first output token
        while n < max_tokens:
            prop = propose(out[n - 1])
            acc = 0
            while acc < k and prop[acc] == out[n + acc]:
                acc += 1
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + k, accepted + acc
            for i in range(acc):
                per_pos[i] += 1
            n += acc + 1
    return drafts, draft_tokens, accepted, per_pos


def chain(step: Callable[[int], int], k: int) -> Callable[[int], list[int]]:
    """propose(anchor) = [step(anchor), step(step(anchor)), ...] (k drafts)."""

    def propose(anchor: int) -> list[int]:
        out = [step(anchor)]
        while len(out) < k:
            out.append(step(out[-1]))
        return out

    return propose


def record_draft_confidences(llm, floor: float | None = None) -> list[list[float]]:
    """For an engine shaped by its drafts' confidence (adaptive_draft_confidence): price its
    steps with a cost model of our own (rows and passes cheap; not the one measured at start-up
    on whatever machine runs the test, so the requests draft alike everywhere), force the
    worker's per-request floor (a next draft expected below it is not drafted) when given, and
    return the list every step's reported confidences (one list per request that drafted) are
    appended to."""
    from vllm.v1.core.sched.spec_k import StepCostModel

    sched = llm.llm_engine.scheduler
    conf = sched.spec_k.confidence
    assert conf is not None, "an adaptive EAGLE3 chain reads the drafts' confidence"
    sched.spec_k.costs = StepCostModel(
        tokens=[1, 64], verify_s=[1.0, 1.1], batch_sizes=[1], draft_step_s=[0.001]
    )
    if floor is not None:
        conf.floor = lambda batch_size, costs: (floor, 0.0)
    reports: list[list[float]] = []
    update = sched.update_from_output

    def recording_update(so, out):
        if out.draft_confidences is not None:
            reports.extend(c for c in out.draft_confidences if c)
        return update(so, out)

    sched.update_from_output = recording_update
    return reports
