# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Speculation is lossless whatever else is in the batch: randomized request mixes (fixed seeds)
on the bundled MTP model, each run without speculation and with an MTP chain, an MTP dynamic tree
(fixed and adaptive) and suffix decoding, compared request by request.

Each mix draws its requests from every sampling feature that reads the tokens a step brings:
greedy and seeded sampling (temperature, top-p, top-k, min-p), presence / frequency /
repetition penalties, logprobs and prompt logprobs, stop strings (with and without the stop
in the output), stop token ids, min_tokens (with ignore_eos), n = 2, logit bias with bad
words, allowed token ids and a JSON schema; and the scheduler's knobs (how many requests run
at once, the token budget: chunked prefill, a KV cache small enough to preempt). The token
ids, text, finish and stop reasons must be equal, logprobs within 1e-4 (the verify pass's
attention sums a row's keys in another order than a one-row decode). Such a run found that a
stop string completed inside a step's accepted drafts kept the step's later tokens."""

from __future__ import annotations

import random

import pytest

from vllm import LLM, SamplingParams
from vllm.model_zoo import TINY_DEEPSEEK_MTP_DIR
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.engine_utils import spec_decode_counts

pytestmark = pytest.mark.usefixtures("pp_forkserver")

MODEL = str(TINY_DEEPSEEK_MTP_DIR)
PROMPTS = [
    "def add(a, b):",
    "class Stack:\n    def __init__(self):",
    "import os\nimport sys\n\n",
    "for i in range(10):",
    "# compute the mean of a list\n",
    "values = [",
    "while True:\n    line = input()",
    "def main():\n    args = parse()",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
KINDS = [
    "greedy", "seeded", "penalties", "logprobs", "stop", "stop_ids", "min_tokens", "n2",
    "bias", "allowed", "json",
]  # fmt: skip
ENGINES = {
    "chain": {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "adaptive_num_speculative_tokens": False,
    },
    "tree": {"method": "mtp", "num_tree_nodes": 8, "adaptive_num_speculative_tokens": False},
    "suffix": {"method": "suffix"},
    # Its shape follows measured step costs (a loaded machine may draft less): equality is
    # checked, not how much it accepted.
    "adaptive tree": {
        "method": "mtp",
        "num_tree_nodes": 8,
        "adaptive_num_speculative_tokens": True,
    },
}


def _params(rng: random.Random, kind: str, i: int) -> SamplingParams:
    kw: dict = {"max_tokens": rng.randint(6, 40), "temperature": 0.0}
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
            "stop": [rng.choice(["(", ":", "\n", " =", "self", ","])],
            "include_stop_str_in_output": rng.random() < 0.5,
        }
    elif kind == "stop_ids":
        kw |= {"stop_token_ids": [rng.randrange(20, 300)], "min_tokens": rng.choice([0, 3])}
    elif kind == "min_tokens":
        kw |= {"min_tokens": min(8, kw["max_tokens"]), "ignore_eos": rng.random() < 0.5}
    elif kind == "n2":
        kw |= {"n": 2}
    elif kind == "bias":
        kw |= {"logit_bias": {rng.randrange(2048): 4.0, rng.randrange(2048): -4.0}}
        kw["bad_words"] = ["self", " in"]
    elif kind == "allowed":
        kw["allowed_token_ids"] = list(range(0, 1500))
    elif kind == "json":
        kw |= {"structured_outputs": StructuredOutputsParams(json=SCHEMA), "max_tokens": 48}
    return SamplingParams(**kw)


def _mix(seed: int):
    rng = random.Random(seed)
    kinds = ["stop"] + [rng.choice(KINDS) for _ in range(rng.randint(5, 9))]
    reqs = [(rng.choice(PROMPTS), _params(rng, k, i)) for i, k in enumerate(kinds)]
    knobs = {
        "max_num_seqs": rng.choice([2, 4, 16]),
        "max_num_batched_tokens": rng.choice([32, 256]),
        "num_gpu_blocks_override": rng.choice([None, 24]),
    }
    return kinds, reqs, knobs


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _run(reqs, knobs, spec=None, pp: int = 1):
    llm = LLM(
        model=MODEL,
        dtype="float32",
        max_model_len=256,
        speculative_config=spec,
        pipeline_parallel_size=pp,
        enable_prefix_caching=True,
        disable_log_stats=False,
        **knobs,
    )
    try:
        outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
        res = []
        for o in outs:
            plp = None
            if o.prompt_logprobs is not None:
                plp = [None if d is None else {t: v.logprob for t, v in d.items()}
                       for d in o.prompt_logprobs]  # fmt: skip
            for c in o.outputs:
                lps = None
                if c.logprobs is not None:
                    lps = [{t: v.logprob for t, v in d.items()} for d in c.logprobs]
                res.append((list(c.token_ids), c.text, c.finish_reason, c.stop_reason, lps, plp))
        return res, spec_decode_counts(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("seed", "pp"), [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_mixed_batch_equals_no_speculation(seed, pp):
    kinds, reqs, knobs = _mix(seed)
    ref, _ = _run(reqs, knobs)
    engines = ENGINES if pp == 1 else {k: ENGINES[k] for k in ("chain", "tree")}
    for name, spec in engines.items():
        got, counts = _run(reqs, knobs, spec, pp)
        assert len(got) == len(ref)
        for i, (r, g) in enumerate(zip(ref, got)):
            assert _close(g, r), (name, i, r[:4], g[:4])
        if name in ("chain", "tree"):  # drafts are accepted: steps bring several tokens
            assert counts[2] > 0, name
    assert len(set(kinds)) >= 4
