# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""K per step: the batch-size schedule and the adaptive K.

- A request running alone verifies K = 3 drafts; a second request joins, and the schedule
  [[1, 1, 3], [2, 8, 0]] takes it to K = 0; the second finishes and it is back at 3. With MTP
  (one layer and two chained layers, drafts depending on the draft's own KV), EAGLE3 (random
  head) and DFlash, at P = 1 and 2: the output is the no-speculation greedy one, and every
  draft verified after the return is the draft a fresh engine proposes from the same context
  (its draft state built by one prefill): the draft KV / carries / context blocks stayed
  correct through the steps that drafted nothing.
- Greedy and seeded text do not depend on the K of each step (fixed K, schedule, adaptive).
- The adaptive K drops to 0 on a head that never accepts (and probes again later), and keeps
  drafting with a head that always accepts.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.testing.engine_utils import make_prompts, run_to_completion
from vllm.testing.spec_checkpoints import (
    make_eagle3_draft,
    make_llama_bigram_target,
    make_mtp_self_draft,
)
from vllm.v1.core.sched.spec_k import StepCostModel
from vllm.v1.engine.llm_engine import LLMEngine

# A CPU-like step cost curve: a few more tokens cost little, a draft step 5% of a step.
CPU_LIKE = StepCostModel(tokens=[1, 64], verify_s=[1.0, 1.5], batch_sizes=[1], draft_step_s=[0.05])

pytestmark = pytest.mark.usefixtures("pp_forkserver")

K = 3
SCHEDULE = [[1, 1, K], [2, 8, 0]]
COMMON = dict(dtype="float32", max_model_len=160, max_num_seqs=4, disable_log_stats=False)
A_PROMPT = make_prompts(512, [23], seed=41)[0]
# Three requests join (so at P = 2, where each batch in flight holds half the requests, A's
# batch still has two).
B_PROMPTS = make_prompts(512, [7, 5, 9], seed=42)
A_TOKENS, B_TOKENS, B_JOINS_AT = 40, 6, 8


def _engine(target: str, spec: dict | None, pp: int = 1, **kw) -> LLMEngine:
    args = EngineArgs(
        model=target, speculative_config=spec, pipeline_parallel_size=pp, **{**COMMON, **kw}
    )
    return LLMEngine.from_engine_args(args)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _switching_run(target: str, spec: dict, pp: int):
    """A alone, B0..B2 join once A has B_JOINS_AT outputs, they finish, A goes on. Returns the
    outputs and, per step that scheduled A, (A's known tokens, the drafts A verified)."""
    spec = {**spec, "num_speculative_tokens_per_batch_size": SCHEDULE}
    eng = _engine(target, {**spec, "adaptive_num_speculative_tokens": False}, pp)
    eng.executor.collective_rpc("record_drafts")
    # Per step that scheduled A: its known tokens, how many of its proposals had come back,
    # and how many drafts of the latest it verifies (the values are the proposing stage's).
    scheduled: list[tuple[int, int, int]] = []
    num_proposals = 0
    sched = eng.scheduler
    schedule, update = sched.schedule, sched.update_from_output

    def recording_schedule(*a, **kw):
        so = schedule(*a, **kw)
        if "A" in so.num_scheduled_tokens:
            req = sched.requests["A"]
            scheduled.append((req.num_tokens, num_proposals, so.num_draft_tokens.get("A", 0)))
        return so

    def counting_update(so, ro):
        nonlocal num_proposals
        i = ro.req_id_to_index.get("A")
        num_proposals += i is not None and bool(ro.sampled_token_ids[i])
        return update(so, ro)

    sched.schedule = recording_schedule  # type: ignore[method-assign]
    sched.update_from_output = counting_update  # type: ignore[method-assign]
    outs: dict[str, list[int]] = {}
    verified: list[tuple[int, list[int]]] = []
    try:
        eng.add_request("A", {"prompt_token_ids": A_PROMPT}, _greedy(A_TOKENS))
        added = False
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
            a = sched.requests.get("A")
            if not added and a is not None and a.num_output_tokens >= B_JOINS_AT:
                for i, p in enumerate(B_PROMPTS):
                    eng.add_request(f"B{i}", {"prompt_token_ids": p}, _greedy(B_TOKENS))
                added = True
        proposals = _draft_log(eng).get("A", [])
        verified = [(t, proposals[p - 1][:n] if n else []) for t, p, n in scheduled]
    finally:
        eng.shutdown()
    return outs, verified


def _draft_log(eng: LLMEngine) -> dict[str, list[list[int]]]:
    """Each request's draft proposals since record_drafts (the proposing stage's log)."""
    logs = [d for d in eng.executor.collective_rpc("draft_log") if d is not None]
    return logs[0] if logs else {}


def _fresh_drafts(target: str, spec: dict, contexts: list[list[int]]) -> list[list[int]]:
    """The drafts a fresh engine proposes from each context (its draft state from one prefill
    of all but the context's last token, which that prefill samples)."""
    eng = _engine(
        target, {**spec, "adaptive_num_speculative_tokens": False}, enable_prefix_caching=False
    )
    eng.executor.collective_rpc("record_drafts")
    got = []
    try:
        for i, ctx in enumerate(contexts):
            rid = f"ref{i}"
            eng.add_request(rid, {"prompt_token_ids": ctx[:-1]}, _greedy(2))
            eng.step()
            req = eng.scheduler.requests[rid]
            assert req.all_token_ids == ctx
            got.append(_draft_log(eng)[rid][0][: req.num_drafts])
            while eng.has_unfinished_requests():
                eng.step()
    finally:
        eng.shutdown()
    return got


def _no_spec(target: str) -> dict[str, list[int]]:
    eng = _engine(target, None)
    out: dict[str, list[int]] = {}
    try:
        eng.add_request("A", {"prompt_token_ids": A_PROMPT}, _greedy(A_TOKENS))
        for i, p in enumerate(B_PROMPTS):
            eng.add_request(f"B{i}", {"prompt_token_ids": p}, _greedy(B_TOKENS))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        eng.shutdown()
    return out


@pytest.fixture(scope="module")
def heads(llama_dir, deepseek_v3_mtp1_dir, deepseek_v3_mtp2_dir, tmp_path_factory):
    """method -> (target, speculative_config without K) builders, made on first use."""
    tmp = tmp_path_factory
    made: dict[str, tuple[str, dict]] = {}

    def mtp(src: str, name: str) -> tuple[str, dict]:
        d = make_mtp_self_draft(tmp.mktemp(name), src, target_scale=0.2, draft_block_scale=2.0)
        return d, {"method": "mtp"}

    def eagle3() -> tuple[str, dict]:
        head = make_eagle3_draft(tmp.mktemp("k_eagle3"), llama_dir, aux_layers=(1, 2, 3))
        return llama_dir, {"method": "eagle3", "model": head}

    def dflash() -> tuple[str, dict]:
        pytest.importorskip("speculators", reason="speculators is a test dependency")
        from vllm.testing.speculators_dflash_heads import make_speculators_dflash

        target = make_llama_bigram_target(tmp.mktemp("k_near"), llama_dir, target_scale=0.3)
        head = make_speculators_dflash(tmp.mktemp("k_dflash"), target, speculative_tokens=K)
        return target, {"model": head}

    builders: dict[str, Callable[[], tuple[str, dict]]] = {
        "mtp": lambda: mtp(deepseek_v3_mtp1_dir, "k_mtp1"),
        "mtp_chained": lambda: mtp(deepseek_v3_mtp2_dir, "k_mtp2"),
        "eagle3": eagle3,
        "dflash": dflash,
    }

    def get(method: str) -> tuple[str, dict]:
        if method not in made:
            made[method] = builders[method]()
        target, spec = made[method]
        return target, {**spec, "num_speculative_tokens": K}

    return get


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("method", ["mtp", "mtp_chained", "eagle3", "dflash"])
def test_k_switches_3_0_3_mid_request(heads, method, pp):
    target, spec = heads(method)
    outs, verified = _switching_run(target, spec, pp)
    assert outs == _no_spec(target)
    ks = [len(d) for _, d in verified]
    # (After the prefill) 3 while alone, 0 while the Bs run, 3 again once they finished.
    assert ks[0] == 0
    first0 = ks.index(0, 1)
    back = next(i for i in range(first0, len(ks)) if ks[i] == K)
    assert K in ks[1:first0] and all(k == 0 for k in ks[first0:back])
    after = [(n, d) for n, d in verified[back:] if d][:4]
    assert len(after) >= 2
    full = A_PROMPT + outs["A"]
    want = _fresh_drafts(target, spec, [full[:n] for n, _ in after])
    assert [d for _, d in after] == [w[:K] for w in want]


PROMPTS = make_prompts(512, [21, 6, 34, 13], seed=43)
SEEDED = [
    SamplingParams(temperature=0.8, seed=5 + i, max_tokens=24, ignore_eos=True) for i in range(2)
]


def _generate(target: str, spec: dict | None) -> list[list[int]]:
    """Two greedy and two seeded requests together."""
    eng = _engine(target, spec)
    params = [_greedy(24), _greedy(24), *SEEDED]
    return run_to_completion(eng, PROMPTS, params)


def test_output_does_not_depend_on_k_per_step(heads):
    target, spec = heads("mtp")
    ref = _generate(target, None)
    variants = {
        "fixed": {**spec, "adaptive_num_speculative_tokens": False},
        "adaptive": spec,
        "schedule": {
            **spec,
            "adaptive_num_speculative_tokens": False,
            "num_speculative_tokens_per_batch_size": [[1, 2, 1], [3, 8, 2]],
        },
        "schedule+adaptive": {
            **spec,
            "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 8, 0]],
        },
    }
    for name, v in variants.items():
        assert _generate(target, v) == ref, name


def _verified_ks(
    target: str, spec: dict | None, prompt: list[int], n: int, costs: StepCostModel | None = None
) -> tuple[list[int], list[int]]:
    """(output, drafts verified per decode step) of one request running alone. costs replaces
    the step costs start-up measured (timings of a tiny model on a busy machine are noise; the
    measurement has its own tests)."""
    eng = _engine(target, spec)
    ks: list[int] = []
    sched = eng.scheduler
    if costs is not None:
        assert sched.spec_k is not None
        sched.spec_k.costs = costs
    schedule = sched.schedule

    def recording_schedule(*a, **kw):
        so = schedule(*a, **kw)
        if "r" in so.num_scheduled_tokens and sched.requests["r"].num_output_tokens > 0:
            ks.append(so.num_draft_tokens.get("r", 0))
        return so

    sched.schedule = recording_schedule  # type: ignore[method-assign]
    out: list[int] = []
    try:
        eng.add_request("r", {"prompt_token_ids": prompt}, _greedy(n))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out = list(o.outputs[0].token_ids)
    finally:
        eng.shutdown()
    return out, ks


def test_adaptive_k_drops_to_zero_on_a_head_that_never_accepts(llama_dir, tmp_path_factory):
    """A DFlash head with every weight zero drafts token 0 at every position, which the target
    never emits: every draft is rejected. The adaptive K stops drafting within a few steps,
    probes the full K again after 8, 16, 32 steps, and the output is unchanged."""
    pytest.importorskip("speculators", reason="speculators is a test dependency")
    from vllm.testing.speculators_dflash_heads import make_speculators_dflash

    head = make_speculators_dflash(
        tmp_path_factory.mktemp("k_zero_head"), llama_dir, speculative_tokens=K, init="zero"
    )
    prompt = PROMPTS[0]
    ref, _ = _verified_ks(llama_dir, None, prompt, 80)
    assert 0 not in ref
    spec = {"model": head, "num_speculative_tokens": K}
    out, ks = _verified_ks(llama_dir, spec, prompt, 80, CPU_LIKE)
    assert out == ref
    first0 = ks.index(0)
    assert first0 <= 4
    probes = [i for i in range(first0, len(ks)) if ks[i]]
    assert 1 <= len(probes) <= 4 and all(ks[p] == K for p in probes)
    assert probes[0] - first0 == 7  # the 8th step at 0 probes
    # Fixed K: every step verifies K drafts, all rejected.
    out_fixed, ks_fixed = _verified_ks(
        llama_dir, {**spec, "adaptive_num_speculative_tokens": False}, prompt, 80
    )
    assert out_fixed == ref and set(ks_fixed) == {K}


def test_adaptive_k_keeps_drafting_with_a_head_that_always_accepts(
    deepseek_v3_mtp1_dir, tmp_path_factory
):
    target = make_mtp_self_draft(tmp_path_factory.mktemp("k_self"), deepseek_v3_mtp1_dir)
    spec = {"method": "mtp", "num_speculative_tokens": K}
    prompt = PROMPTS[2]
    ref, _ = _verified_ks(target, None, prompt, 60)
    out, ks = _verified_ks(target, spec, prompt, 60, CPU_LIKE)
    assert out == ref
    assert ks[3:] == [K] * len(ks[3:])
