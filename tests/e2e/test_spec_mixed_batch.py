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

from vllm import LLM
from vllm.model_zoo import TINY_DEEPSEEK_MTP_DIR
from vllm.testing.engine_utils import spec_decode_counts
from vllm.testing.request_mix import KINDS, outputs, random_knobs, random_params, same_outputs

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


def _mix(seed: int):
    rng = random.Random(seed)
    # Every mix has a stop-string request: the bug such runs found.
    kinds, params = random_params(rng, rng.randint(6, 10), vocab_size=2048, first="stop")
    reqs = [(rng.choice(PROMPTS), sp) for sp in params]
    return kinds, reqs, random_knobs(rng, small_kv_blocks=24)


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
        return outputs(outs), spec_decode_counts(llm)
    finally:
        llm.shutdown()


# (seed, P): mixes that between them hold every kind of request (the test below); in 19, 21
# and 13 a stop string ends a request inside a step (they failed on that bug).
MIXES = [(19, 1), (21, 1), (6, 1), (13, 2)]


def test_the_mixes_cover_every_kind():
    assert set().union(*(_mix(seed)[0] for seed, _ in MIXES)) == set(KINDS)


@pytest.mark.parametrize(("seed", "pp"), MIXES)
def test_mixed_batch_equals_no_speculation(seed, pp):
    _, reqs, knobs = _mix(seed)
    ref, _ = _run(reqs, knobs)
    engines = ENGINES if pp == 1 else {k: ENGINES[k] for k in ("chain", "tree")}
    for name, spec in engines.items():
        got, counts = _run(reqs, knobs, spec, pp)
        assert len(got) == len(ref)
        for i, (r, g) in enumerate(zip(ref, got)):
            assert same_outputs(g, r), (name, i, r[:4], g[:4])
        if name in ("chain", "tree"):  # drafts are accepted: steps bring several tokens
            assert counts[2] > 0, name
