# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Start-up warm-up: one small step of each kind through every stage before serving.

Two steps of WARMUP_TOKENS at most: a few short requests' prompts next to a fresh prefill chunk
of a longer prompt, then the short requests' decode (speculating: verify) rows next to that
prompt's second chunk, which attends to its cached context; greedy and seeded-random rows both;
then all are freed. The
steps go through a throwaway scheduler over the same KV pool, so they take real blocks, state
slots and the real PP / speculative path, and leave nothing behind in the serving scheduler (no
cached prefixes, no metrics). What this buys: every kernel (the CPU kernels' library, each
attention path, the samplers, the drafter) has run once and every lazily built library state
exists when start-up ends, so the first real request does not pay for them. The memory side
(pools written when allocated, the heap grown to what a full step needs) is the workers' own
(ModelRunner.initialize_kv_cache), so no full token budget is replayed here: on 2 CPU cores a
2048-token step of a 135M model takes seconds, and the old warm-up ran several.
"""

from __future__ import annotations

import time

from vllm import envs
from vllm.config import VllmConfig
from vllm.config.scheduler import WARMUP_TOKENS
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.spec_k import StepCostModel, draft_passes
from vllm.v1.executor.abstract import Executor
from vllm.v1.request import Request, RequestStatus

logger = init_logger(__name__)

# Short requests that share the warm-up's later steps (decode / verify rows).
WARMUP_SHORT_REQUESTS = 3


def warm_up(
    vllm_config: VllmConfig, executor: Executor, num_blocks: int, num_slots: int
) -> tuple[int, int, int]:
    """Run the dummy steps; raise what a stage raised (start-up then fails as a load would).
    Returns (requests, prompt tokens, steps)."""
    t0 = time.perf_counter()
    sc = vllm_config.scheduler_config
    max_model_len = vllm_config.model_config.max_model_len
    assert max_model_len is not None  # resolved from the checkpoint by ModelConfig
    bs = vllm_config.cache_config.block_size
    k = vllm_config.num_speculative_tokens
    budget = max(1, min(sc.max_num_batched_tokens, WARMUP_TOKENS))
    # Room for the prompt, one sampled token and its drafts, within one request's length.
    per_req = max(1, min(max_model_len - 2 - k, sc.max_num_batched_tokens))
    # Short requests first, so their prompts share the first step with the long prompt's
    # first chunk and their decode / verify rows the second step with its second chunk.
    n_short = min(sc.max_num_seqs - 1, WARMUP_SHORT_REQUESTS)
    short_len = min(per_req, 2)
    first_chunk = max(1, budget - n_short * short_len)
    # The long prompt's second chunk (when chunking is allowed) attends to its cached first.
    long_len = first_chunk + budget // 2 if sc.enable_chunked_prefill else first_chunk
    lens = [short_len] * n_short + [min(per_req, long_len)]

    # Blocks a request takes: prompt + the decode step's 1 + k tokens.
    def blocks(n: int) -> int:
        return -(-(n + 2 + k) // bs)

    fits: list[int] = []
    for n in lens:
        if sum(blocks(m) for m in fits) + blocks(n) <= num_blocks:
            fits.append(n)
    if not fits:
        return 0, 0, 0
    sched = Scheduler(vllm_config, num_blocks, num_slots)
    sched.max_num_batched_tokens = budget
    vocab = max(1, vllm_config.model_config.vocab_size)
    for i, n in enumerate(fits):
        # Greedy and seeded-random rows both, so both sampling paths run; the long prompt
        # samples once, when its last chunk is done (alone, it decodes one step too).
        long = i == len(fits) - 1 and len(fits) > n_short
        params = SamplingParams(
            max_tokens=1 if long and n_short else 2,
            temperature=0.0 if i % 2 == 0 else 1.0,
            seed=i,
        )
        ids = [(i * 7919 + j * 31) % vocab for j in range(n)]
        sched.add_request(Request(f"warmup-{i}", ids, params, seed=i))
    steps = 0
    while sched.has_unfinished_requests() and steps < 32:
        so = sched.schedule()
        if so.total_num_scheduled_tokens == 0 and not so.finished_req_ids:
            break
        sched.update_from_output(so, executor.execute_model(so))
        steps += 1
    # Free the stages' request slots (the finished ids go out with the next step).
    so = sched.schedule()
    if so.finished_req_ids or so.total_num_scheduled_tokens:
        executor.execute_model(so)
    logger.info(
        "Warm-up: %d dummy requests, %d prompt tokens, %d steps in %.2f s",
        len(fits),
        sum(fits),
        steps,
        time.perf_counter() - t0,
    )
    return len(fits), sum(fits), steps


def measure_step_costs(
    vllm_config: VllmConfig, executor: Executor, num_blocks: int, num_slots: int
) -> StepCostModel | None:
    """The step cost model the adaptive K needs (vllm.v1.core.sched.spec_k), timed through the
    real stages after the warm-up: per batch size B (1, 2, 4, ... up to max_num_seqs and 16),
    steps verifying 0, about K / 3, 2K / 3 and K dummy drafts per request without drafting,
    and one verifying K drafting K steps (the fastest of 3 interleaved repeats: on a shared
    CPU other work only ever adds time, and a busy moment taken for a real cost would mislead
    every later choice); a draft step is the difference over the draft passes K drafts take
    (a chain's K steps, a tree's depth passes: spec_k.draft_passes). Bounded in time: batch
    sizes are measured in increasing order while the next one is expected to end within
    VLLM_STEP_COST_BUDGET_S of the start (the first two always; the model extrapolates
    linearly past the last one measured). None when speculation or the adaptive K is off or
    the dummy requests do not fit."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.adaptive_num_speculative_tokens:
        return None
    t0 = time.perf_counter()
    sc = vllm_config.scheduler_config
    max_model_len = vllm_config.model_config.max_model_len
    assert max_model_len is not None  # resolved from the checkpoint by ModelConfig
    k = spec.num_speculative_tokens
    passes = draft_passes(spec)
    k_passes = k if passes is None else max(passes[k], 1)
    prompt, reps = 4, 3
    # (drafts verified, draft steps run). Verify steps at a third and two thirds of K too: the
    # curve is convex on a CPU (flat while the weights stream, then the FMA units' slope), so
    # a line from 0 to K drafts would price the first few drafts far above their cost.
    mids = sorted({max(1, k // 3), max(1, (2 * k) // 3)} - {k})
    configs = [(0, 0), *((m, 0) for m in mids), (k, 0), (k, k)]
    per_req = prompt + 1 + len(configs) * reps * (k + 1) + k + 1
    blocks = -(-per_req // vllm_config.cache_config.block_size)
    limit = min(sc.max_num_seqs, 16, num_blocks // max(blocks, 1))
    limit = min(limit, sc.max_num_batched_tokens // (k + 1))
    if per_req >= max_model_len or limit < 1:
        return None
    sizes = sorted({b for b in (1, 2, 4, 8, 16) if b <= limit} | {limit})
    vocab = max(1, vllm_config.model_config.vocab_size)
    verify: dict[int, list[float]] = {}
    draft_step: dict[int, float] = {}
    budget_s = envs.VLLM_STEP_COST_BUDGET_S
    measured: list[int] = []
    last_b, last_s = 0, 0.0
    for b in sizes:
        elapsed = time.perf_counter() - t0
        # A size's measurement costs about its batch size's share of the last one's.
        expected = last_s * b / last_b if last_b else 0.0
        if len(measured) >= 2 and elapsed + expected > budget_s:
            break
        t_size = time.perf_counter()
        sched = Scheduler(vllm_config, num_blocks, num_slots)
        policy = sched.spec_k
        assert policy is not None
        ids = [f"cost-{b}-{i}" for i in range(b)]
        params = SamplingParams(max_tokens=max_model_len, temperature=0.0, ignore_eos=True)
        for i, rid in enumerate(ids):
            toks = [(i * 31 + j * 7) % vocab for j in range(prompt)]
            sched.add_request(Request(rid, toks, params, seed=i))
        policy.force_k = 0
        so = sched.schedule()
        sched.update_from_output(so, executor.execute_model(so))
        times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
        for _ in range(reps):
            for m, ds in configs:
                for rid in ids:
                    sched.requests[rid].num_drafts = m
                policy.force_k = ds
                t = time.perf_counter()
                so = sched.schedule()
                out = executor.execute_model(so)
                times[(m, ds)].append(time.perf_counter() - t)
                sched.update_from_output(so, out)
        sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        so = sched.schedule()
        executor.execute_model(so)
        best = {c: min(v) for c, v in times.items()}
        for m in (0, *mids, k):
            verify.setdefault(b * (m + 1), []).append(best[(m, 0)])
        draft_step[b] = max(best[(k, k)] - best[(k, 0)], 0.0) / k_passes
        measured.append(b)
        last_b, last_s = b, time.perf_counter() - t_size
    sizes = measured
    tokens = sorted(verify)
    raw = [sum(verify[t]) / len(verify[t]) for t in tokens]
    model = StepCostModel(
        tokens=tokens,
        verify_s=_monotone(raw),
        batch_sizes=sizes,
        # A difference of two timings: fitted the same way (one noisy pair can read 0).
        draft_step_s=_fit_line(sizes, [draft_step[b] for b in sizes]),
    )
    logger.info(
        "Step costs for the adaptive K (%.2f s): verify ms by tokens %s (made monotone %s), one "
        "draft step ms by batch size %s",
        time.perf_counter() - t0,
        {t: round(v * 1e3, 2) for t, v in zip(tokens, raw)},
        {t: round(v * 1e3, 2) for t, v in zip(model.tokens, model.verify_s)},
        {b: round(v * 1e3, 2) for b, v in zip(model.batch_sizes, model.draft_step_s)},
    )
    return model


def _fit_line(xs: list[int], ys: list[float]) -> list[float]:
    """The least-squares line a + b x (b >= 0) through measured times, at xs: a step's cost
    grows about linearly with its tokens (or batch size) at these sizes, and one timing of a
    busy machine can be off by half, which a per-point curve would take for a real step."""
    if len(xs) < 3:
        return list(ys)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0) if var else 0.0
    a = max(my - b * mx, min(ys) / 2, 0.0)
    return [a + b * x for x in xs]


def _monotone(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a step with more tokens
    never costs less. Keeps a real jump (on a CPU, a single-row step runs a matrix-vector path
    and two rows cost much more) and averages out a timing the busy machine inflated."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * int(c)
    return out
