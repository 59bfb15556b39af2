# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""DFlash / DSpark end to end, with P = 1, 2 and 4 pipeline stages (CPU, gloo).

The targets are the tiny Llama and Qwen2 with their attention / MLP outputs scaled down, so
their greedy next token is mostly a function of the current one (a "bigram" map b). The heads
are constructed, in the speculators format, so that their blocks are known without running
them: every draft layer is the identity (zero attention and MLP outputs) and the head shares
the target's embedding and LM head, so a slot holding token t predicts b(t):
- DFlash (sample_from_anchor): drafts [b(anchor), b(mask), b(mask), ...];
- DSpark (vanilla Markov head W2 W1[prev] = 100 * onehot(b(prev))): drafts the chain
  [b(anchor), b(b(anchor)), ...].
Speculative decoding over the target's greedy output is then simulated independently (every
step verifies the drafts from the last token: accept the longest matching prefix plus one),
which gives the exact drafts / draft tokens / accepted / per-position counts the engine must
report - partial, non-zero acceptance - at every P, with the greedy tokens equal to no
speculation. The heads also ship no embedding, so under PP the target keeps its embedding on
the last stage for them. Seeded sampling (greedy and sampled drafts) gives the tokens of
speculation-free seeded sampling at P = 1 and P = 2. `vllm serve -pp 2` with a DSpark head
answers like no speculation and its /metrics counts are the simulated ones.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import (
    chain,
    make_prompts,
    simulate_spec_decode,
    spec_decode_counts,
)
from vllm.testing.spec_checkpoints import make_llama_bigram_target
from vllm.testing.speculators_dflash_heads import MASK, bigram_map, make_bigram_head

pytest.importorskip("speculators", reason="speculators is a test dependency (see README)")
pytestmark = pytest.mark.usefixtures("pp_forkserver")

LENGTHS = [21, 6, 34]
MAX_TOKENS = 16
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)


def expected_counts(ref: list[list[int]], b: torch.Tensor, dspark: bool, k: int) -> tuple:
    """Metrics of speculative decoding over the greedy outputs ref (each at least
    MAX_TOKENS + k + 1 long) with the constructed head's drafts."""
    if dspark:
        propose = chain(lambda t: int(b[t]), k)
    else:

        def propose(anchor: int) -> list[int]:
            return [int(b[anchor])] + [int(b[MASK])] * (k - 1)

    return simulate_spec_decode(ref, propose, k, MAX_TOKENS)


def _run(target: str, prompts, params, spec=None, pp: int = 1):
    llm = LLM(model=target, pipeline_parallel_size=pp, speculative_config=spec, **COMMON)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], spec_decode_counts(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def targets(llama_dir, qwen2_dir, tmp_path_factory) -> dict[str, str]:
    return {
        name: make_llama_bigram_target(
            tmp_path_factory.mktemp(f"{name}_near"), src, target_scale=0.3
        )
        for name, src in (("llama", llama_dir), ("qwen2", qwen2_dir))
    }


class _Cache:
    def __init__(self, targets, tmp_path_factory) -> None:
        self.targets = targets
        self.tmp = tmp_path_factory
        self.prompts = make_prompts(512, LENGTHS, seed=11)
        self.runs: dict = {}
        self.heads: dict = {}

    @property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.targets["llama"])

    def head(self, target: str, method: str, k: int) -> str:
        key = (target, method, k)
        if key not in self.heads:
            out = self.tmp.mktemp(f"{target}_{method}_k{k}")
            self.heads[key] = make_bigram_head(out, self.targets[target], method == "dspark", k)
        return self.heads[key]

    def run(self, target: str, method: str | None, k: int, pp: int, params=None, **spec_kw):
        params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        key = (target, method, k, pp, repr(params), tuple(sorted(spec_kw.items())))
        if key not in self.runs:
            spec = None
            if method is not None:
                spec = {
                    "model": self.head(target, method, k),
                    "adaptive_num_speculative_tokens": False,
                    "num_speculative_tokens": k,
                }
                spec.update(spec_kw)
            self.runs[key] = _run(self.targets[target], self.prompts, params, spec, pp)
        return self.runs[key]

    def reference(self, target: str, k: int) -> list[list[int]]:
        long = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + 8, ignore_eos=True)
        return self.run(target, None, 0, 1, long)[0]


@pytest.fixture(scope="module")
def cache(targets, tmp_path_factory) -> _Cache:
    return _Cache(targets, tmp_path_factory)


CASES = [
    # (target, method, K, P)
    *[(t, m, k, 1) for t, m, k in [("llama", "dflash", 3), ("llama", "dspark", 7)]],
    *[(t, m, k, 1) for t, m, k in [("qwen2", "dspark", 3), ("qwen2", "dflash", 7)]],
    ("llama", "dflash", 3, 2),
    ("llama", "dspark", 7, 2),
    ("qwen2", "dspark", 3, 2),
    ("qwen2", "dflash", 7, 2),
    ("llama", "dspark", 7, 4),
    ("qwen2", "dspark", 3, 4),
    ("llama", "dflash", 3, 4),
    ("qwen2", "dflash", 7, 4),
]


@pytest.mark.parametrize("target,method,k,pp", CASES)
def test_lossless_and_known_acceptance(cache, target, method, k, pp):
    ref = cache.reference(target, k)
    tokens, counts = cache.run(target, method, k, pp)
    assert tokens == [r[:MAX_TOKENS] for r in ref]
    b = bigram_map(cache.targets[target])
    want = expected_counts(ref, b, method == "dspark", k)
    assert counts == want, (counts, want)
    assert 0 < want[2] < want[1], "acceptance must be partial for this test to mean anything"
    assert want[3][1] > 0 if method == "dspark" else want[3][0] > 0
    if pp > 1:
        assert counts == cache.run(target, method, k, 1)[1]
    print(f"{target} {method} K={k} P={pp}: drafts, draft tokens, accepted, per pos = {counts}")


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_seeded_sampling_reproducible(cache, draft_sample_method):
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref, _ = cache.run("llama", None, 0, 1, seeded)
    kw = {"draft_sample_method": draft_sample_method}
    tokens1, counts1 = cache.run("llama", "dspark", 3, 1, seeded, **kw)
    tokens2, counts2 = cache.run("llama", "dspark", 3, 2, seeded, **kw)
    assert tokens1 == ref
    assert tokens2 == ref
    assert counts1 == counts2 and counts1[2] > 0


def test_serve_pp2_dspark(cache, tmp_path):
    """`vllm serve TARGET -pp 2 --speculative-config '{"method":"dspark","model":...}'` (K
    from the checkpoint): the completions are the no-spec ones and /metrics counts exactly
    the drafts the simulation predicts (one request at a time; the drafts depend only on each
    request's own tokens)."""
    import httpx
    import openai

    from vllm.testing.remote_server import RemoteServer

    k = 3
    target = cache.targets["llama"]
    ref = cache.reference("llama", k)
    spec = json.dumps(
        {
            "method": "dspark",
            "model": cache.head("llama", "dspark", k),
            "adaptive_num_speculative_tokens": False,
        }
    )
    with RemoteServer(
        target,
        ["-pp", "2", "--dtype", "float32", "--max-model-len", "128", "--speculative-config", spec],
        tmp_path / "serve.log",
    ) as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
        for prompt, want in zip(cache.prompts, ref):
            res = client.completions.create(
                model=target,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            assert len(res.choices[0].logprobs.tokens) == MAX_TOKENS, server.log_tail()
            assert res.choices[0].text == cache.tokenizer.decode(want[:MAX_TOKENS])
        got: dict[str, float] = {}
        for line in httpx.get(server.url("/metrics"), timeout=30).text.splitlines():
            if line.startswith("vllm:spec_decode_num_"):
                key, value = line.rsplit(" ", 1)
                pos = re.search(r'position="(\d+)"', key)
                name = key.split("{")[0] + (f"[{pos.group(1)}]" if pos else "")
                got[name] = got.get(name, 0.0) + float(value)
        drafts, draft_tokens, accepted, per_pos = expected_counts(ref, bigram_map(target), True, k)
        assert got["vllm:spec_decode_num_drafts_total"] == drafts, got
        assert got["vllm:spec_decode_num_draft_tokens_total"] == draft_tokens, got
        assert got["vllm:spec_decode_num_accepted_tokens_total"] == accepted, got
        for i, n in enumerate(per_pos):
            assert got.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]", 0) == n
        assert accepted > 0
        assert server.stop(timeout=60) == 0, server.log_tail()
