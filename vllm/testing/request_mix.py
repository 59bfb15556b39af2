# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Randomized request mixes for differential runs (speculation vs none, one layout vs another):
every sampling feature that reads the tokens a step brings, drawn from a seeded generator, and
the outputs reduced to what must be equal.

    kinds, params = random_params(rng, n, vocab_size=2048)
    outputs(llm.generate(prompts, params))  # token ids, text, finish / stop reason, logprobs
    same_outputs(a, b)                      # equal, logprobs within 1e-4
"""

from __future__ import annotations

import random
from typing import Any

from vllm.sampling_params import SamplingParams, StructuredOutputsParams

KINDS = (
    "greedy", "seeded", "penalties", "logprobs", "stop", "stop_ids", "min_tokens", "n2",
    "bias", "allowed", "bad_words", "json",
)  # fmt: skip
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
STOP_STRINGS = ("(", ":", "\n", " =", "self", ",", ".", " the")
BAD_WORDS = ("self", " in", " the", " a")
LOGPROB_ATOL = 1e-4


def sampling_params(
    rng: random.Random, kind: str, i: int, vocab_size: int, max_tokens: int = 40
) -> SamplingParams:
    """One request's parameters of the given kind (request index i keys its seed)."""
    kw: dict[str, Any] = {"max_tokens": rng.randint(6, max_tokens), "temperature": 0.0}
    if kind not in ("greedy", "json"):
        kw |= {"temperature": rng.choice([0.3, 0.7, 1.0]), "seed": 100 + i}
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.3:
            kw["min_p"] = 0.05
    if kind == "penalties":
        kw |= {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
    elif kind == "logprobs":
        kw |= {"logprobs": 3, "prompt_logprobs": rng.choice([None, 2])}
    elif kind == "stop":
        kw |= {
            "stop": [rng.choice(STOP_STRINGS)],
            "include_stop_str_in_output": rng.random() < 0.5,
        }
    elif kind == "stop_ids":
        kw |= {
            "stop_token_ids": [rng.randrange(20, min(300, vocab_size))],
            "min_tokens": rng.choice([0, 3]),
            "include_stop_str_in_output": rng.random() < 0.5,
        }
    elif kind == "min_tokens":
        kw |= {"min_tokens": min(8, kw["max_tokens"]), "ignore_eos": rng.random() < 0.5}
    elif kind == "n2":
        kw["n"] = 2
    elif kind == "bias":
        kw["logit_bias"] = {rng.randrange(vocab_size): 4.0, rng.randrange(vocab_size): -4.0}
    elif kind == "allowed":
        kw["allowed_token_ids"] = list(range(0, vocab_size * 3 // 4))
    elif kind == "bad_words":
        kw["bad_words"] = list(BAD_WORDS)
    elif kind == "json":
        kw |= {"structured_outputs": StructuredOutputsParams(json=JSON_SCHEMA), "max_tokens": 48}
    return SamplingParams(**kw)


def random_params(
    rng: random.Random, n: int, vocab_size: int, first: str | None = None
) -> tuple[list[str], list[SamplingParams]]:
    """n requests' kinds and parameters (the first of kind `first` when given)."""
    kinds = [rng.choice(KINDS) for _ in range(n)]
    if first is not None:
        kinds[0] = first
    return kinds, [sampling_params(rng, k, i, vocab_size) for i, k in enumerate(kinds)]


def random_knobs(rng: random.Random, small_kv_blocks: int) -> dict[str, Any]:
    """Scheduler knobs: requests at once, the token budget (chunked prefill), and sometimes a
    KV cache of small_kv_blocks blocks (preemption)."""
    return {
        "max_num_seqs": rng.choice([2, 4, 16]),
        "max_num_batched_tokens": rng.choice([32, 256, 2048]),
        "num_gpu_blocks_override": rng.choice([None, small_kv_blocks]),
    }


def outputs(request_outputs) -> list[tuple]:
    """Per completion: (token ids, text, finish reason, stop reason, logprobs as {id: value},
    the request's prompt logprobs likewise)."""
    res = []
    for o in request_outputs:
        plp = None
        if o.prompt_logprobs is not None:
            plp = [
                None if d is None else {t: v.logprob for t, v in d.items()}
                for d in o.prompt_logprobs
            ]
        for c in o.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [{t: v.logprob for t, v in d.items()} for d in c.logprobs]
            res.append((list(c.token_ids), c.text, c.finish_reason, c.stop_reason, lps, plp))
    return res


def same_outputs(a: Any, b: Any) -> bool:
    """Equal, floats (logprobs) within LOGPROB_ATOL: a prefill's BLAS product is not
    row-invariant (the engines chunk and batch prefills differently), and the attention's key
    split follows the step's rows."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < LOGPROB_ATOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_outputs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_outputs(x, y) for x, y in zip(a, b))
    return a == b
