# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft trees vs a chain vs no speculation: SmolLM2-135M-Instruct + the bundled EAGLE3 head.

Engines: no speculation, a chain of K drafts (fixed K), static trees (speculative_token_tree)
and, where given, a dynamic tree (dynN: num_tree_nodes N; dynNkTdD: also tree_top_k T,
tree_max_depth D). A name ending in "a" (chain3a, tree6a, dyn10a, dyn10k2d6a) is the same engine
with the adaptive shape (the step-cost model picks each request's chain length / tree prefix
every step); without it K is fixed. Held-out chat
prompts, batch 1 (requests one after another) and larger batches B (B requests together),
temperature 0 and a seeded temperature. All engines are built first; every repeat times each
(batch, temperature, engine) once in an order that rotates between repeats; medians are
reported. Prints tokens/s, the ratio to no speculation, mean accepted tokens and verified
drafts per verify step (a step of a request that verified drafts), tokens and verified drafts
per request step (every scheduled step of every request, prefill and steps verifying nothing
included), the acceptance per depth, and whether the text equals no speculation's.

    python benchmarks/tree_smollm2.py [--engines none chain3 tree6 tree10 dyn10 chain3a dyn16a]
        [--batch 1 8] [--temperature 0 0.7] [--repeats 3] [--output-len 64] [--prompts 4]
        [--waves W]   (one batch B: W x B requests kept B at a time, the steady state)
        [--alt-head DIR]   (engines named NAME-alt, e.g. chain3a-alt, draft with that head)

An engine named NAME-f32w is NAME with the head's weights widened to fp32 at load (as before
the engine kept a bf16 head's linear weights in bf16 under an fp32 target): the same drafts,
twice the weight bytes - the paired reference for that change. NAME-nodefer is NAME with the
draft's first pass run every step, also while no request drafts (before the deferral).
NAME-pos is an adaptive EAGLE3 chain shaped by per-position acceptance averages instead of the
drafts' own confidence (adaptive_draft_confidence off: the shape before it).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_flags, smollm2
from benchmarks.eagle3_smollm2 import heldout_chats

TREES = {  # (adaptive: the same name + "a")
    "tree6": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)]",
    "tree10": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), "
    "(0, 0, 0, 0)]",
    "tree16": "[(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), "
    "(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]",
}


def spec_of(name: str, alt_head: str | None = None, method: str = "eagle3") -> dict | None:
    """The speculative_config of an engine name; a name ending in "-alt" drafts with the head
    folder alt_head instead of the bundled one (two heads compared in one run). method "mtp":
    the target's own MTP layers draft (no head folder)."""
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR

    if name == "none":
        return None
    head = str(SMOLLM2_EAGLE3_DIR)
    name = name.removesuffix("-f32w").removesuffix("-nodefer")
    # NAME-pos: the adaptive chain by per-position averages, not the drafts' confidence.
    by_confidence = not name.endswith("-pos")
    name = name.removesuffix("-pos")
    if name.endswith("-alt"):
        if alt_head is None:
            raise SystemExit(f"engine {name!r} needs --alt-head")
        name, head = name[: -len("-alt")], alt_head
    adaptive = name.endswith("a")
    name = name[:-1] if adaptive else name
    base = {"method": "eagle3", "model": head} if method == "eagle3" else {"method": method}
    base["adaptive_num_speculative_tokens"] = adaptive
    base["adaptive_draft_confidence"] = by_confidence
    if name.startswith("chain"):
        return {**base, "num_speculative_tokens": int(name[5:])}
    if name in TREES:
        return {**base, "speculative_token_tree": TREES[name]}
    m = re.fullmatch(r"dyn(\d+)(?:k(\d+))?(?:d(\d+))?", name)
    if m:  # dynN[kT][dD]: N nodes, tree_top_k T, tree_max_depth D (defaults where left out)
        extra = {"tree_top_k": int(m[2])} if m[2] else {}
        extra |= {"tree_max_depth": int(m[3])} if m[3] else {}
        return {**base, "num_tree_nodes": int(m[1]), **extra}
    raise SystemExit(f"unknown engine {name!r}")


@contextmanager
def fp32_head_weights(on: bool) -> Iterator[None]:
    """While on: EAGLE3 heads built in this process keep their weights in fp32 (the draft
    loads in-process at P = 1)."""
    from vllm.model_executor.models.llama_eagle3 import LlamaForCausalLMEagle3

    if not on:
        yield
        return
    LlamaForCausalLMEagle3.keeps_exact_bf16_weights = False
    try:
        yield
    finally:
        LlamaForCausalLMEagle3.keeps_exact_bf16_weights = True


def no_deferral(llm, partner=None) -> None:
    """The engine's draft runs its first pass every step, also for requests nobody drafts for
    (the paired reference for the deferral, spec_decode/autoregressive/deferral.py). partner:
    the same engine with the deferral, whose start-up step costs this one takes, so that both
    decide the same drafts (their drafts and acceptance being bit-identical) and only the
    deferral differs."""
    llm.llm_engine.executor.worker.model_runner.speculator.deferral = None
    if partner is not None:
        mine, theirs = llm.llm_engine.scheduler.spec_k, partner.llm_engine.scheduler.spec_k
        if mine is not None and theirs is not None:
            mine.costs = theirs.costs


def counters(llm) -> tuple[float, float, list[float], float]:
    m = {x.name: x for x in llm.get_metrics()}
    d = m.get("vllm:spec_decode_num_drafts")
    a = m.get("vllm:spec_decode_num_accepted_tokens")
    p = m.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    n = m.get("vllm:spec_decode_num_draft_tokens")
    return (
        d.value if d else 0,
        a.value if a else 0,
        list(p.values) if p else [],
        n.value if n else 0,
    )


def count_steps(llm) -> list[int]:
    """[request steps, drafts verified]: every request each scheduled step (prefill chunks
    included) and the drafts it verified, summed as the engine's scheduler runs."""
    sched = llm.llm_engine.scheduler
    schedule, tally = sched.schedule, [0, 0]

    def counting_schedule(*a, **kw):
        so = schedule(*a, **kw)
        tally[0] += len(so.num_scheduled_tokens)
        tally[1] += sum(so.num_draft_tokens.values())
        return so

    sched.schedule = counting_schedule
    return tally


def timed(llm, chats, batch: int, temperature: float, out_len: int, spread: bool = False):
    """batch: requests submitted together (the engine's max_num_seqs may be smaller: then the
    scheduler keeps that many running and starts the next as one finishes); spread: output
    lengths out_len / 2 .. 3 out_len / 2 (seeded), so requests finish at different steps with
    or without speculation and new ones join running batches (the steady state)."""
    from vllm import SamplingParams

    sp: SamplingParams | list[SamplingParams] = SamplingParams(
        temperature=temperature, seed=7, max_tokens=out_len, ignore_eos=True
    )
    if spread:
        rng = random.Random(11)
        sp = [
            SamplingParams(
                temperature=temperature,
                seed=7,
                max_tokens=rng.randint(out_len // 2, out_len * 3 // 2),
                ignore_eos=True,
            )
            for _ in chats
        ]
    d0, a0, p0, _ = counters(llm)
    s0, n0 = llm.bench_steps
    t = time.perf_counter()
    outs = []
    for i in range(0, len(chats), batch):
        part = sp if isinstance(sp, SamplingParams) else sp[i : i + batch]
        outs += llm.chat(chats[i : i + batch], part, use_tqdm=False)
    dt = time.perf_counter() - t
    d1, a1, p1, _ = counters(llm)
    s1, n1 = llm.bench_steps
    p0 = p0 + [0] * (len(p1) - len(p0))
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return toks / dt, d1 - d0, a1 - a0, [b - a for a, b in zip(p0, p1)], ids, n1 - n0, s1 - s0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["none", "chain3", "tree6", "tree10"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--temperature", nargs="+", type=float, default=[0.0, 0.7])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per batch-1 run")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--waves",
        type=int,
        default=1,
        help="batch B > 1: submit W x B requests at once with max_num_seqs B and output "
        "lengths spread over 1/2 .. 3/2 of --output-len (steady state: a finished request's "
        "place is taken by the next, so the batch stays full until the last wave; 1: B "
        "requests of --output-len, the time to finish all of them)",
    )
    ap.add_argument(
        "--alt-head", default=None, help="engines named NAME-alt draft with this head folder"
    )
    args = ap.parse_args()
    if len(args.batch) > 1 and args.waves > 1:
        raise SystemExit("--waves needs one --batch (max_num_seqs is the batch)")
    from vllm import LLM, SamplingParams

    model = smollm2()
    llms = {}
    for e in args.engines:
        with fp32_head_weights(e.endswith("-f32w")):
            llms[e] = LLM(
                model=model,
                dtype=args.dtype,
                speculative_config=spec_of(e, args.alt_head),
                max_model_len=1024,
                max_num_seqs=max(args.batch),
                disable_log_stats=False,
            )
    for e in args.engines:
        if e.endswith("-nodefer"):
            no_deferral(llms[e], llms.get(e.removesuffix("-nodefer")))
    try:
        for llm in llms.values():
            llm.bench_steps = count_steps(llm)
            llm.chat(heldout_chats(1), SamplingParams(max_tokens=8), use_tqdm=False)
        order = [(b, t, e) for b in args.batch for t in args.temperature for e in args.engines]
        samples = defaultdict(list)
        for r in range(args.repeats):
            for b, t, e in order[r % len(order) :] + order[: r % len(order)]:
                n = args.prompts if b == 1 else b * args.waves
                chats = heldout_chats(n)
                submit = b if b == 1 else n
                run = timed(llms[e], chats, submit, t, args.output_len, spread=args.waves > 1)
                samples[(b, t, e)].append(run)
                print(f"  batch {b} T={t} {e} rep {r}: {samples[(b, t, e)][-1][0]:.1f} tok/s")
    finally:
        for llm in llms.values():
            llm.shutdown()
    print("---")
    print(
        f"CPU: {cpu_flags()}; {args.dtype}; output {args.output_len} tokens; "
        f"waves {args.waves} (batch B > 1: {args.waves} x B requests, max_num_seqs B)"
    )
    for b in args.batch:
        for t in args.temperature:
            base = (
                statistics.median(x[0] for x in samples[(b, t, "none")])
                if ((b, t, "none") in samples)
                else None
            )
            for e in args.engines:
                runs = samples[(b, t, e)]
                tps = statistics.median(x[0] for x in runs)
                drafts, acc = sum(x[1] for x in runs), sum(x[2] for x in runs)
                depth = [sum(x[3][i] for x in runs) for i in range(len(runs[0][3]))]
                rates = " ".join(f"{v / drafts:.2f}" for v in depth if v) if drafts else ""
                same = (b, t, "none") in samples and runs[0][4] == samples[(b, t, "none")][0][4]
                ratio = f"{tps / base:.2f}x" if base else "-"
                mal = 1 + acc / drafts if drafts else 1.0
                toks = sum(len(i) for x in runs for i in x[4])
                nodes, req_steps = sum(x[5] for x in runs), max(sum(x[6] for x in runs), 1)
                per_verify = nodes / drafts if drafts else 0.0
                print(
                    f"batch {b:2d} T={t:.1f} {e:12s}: {tps:7.1f} tok/s  {ratio:>6s} of none  "
                    f"accepted/verify step {mal:.2f}  verified/verify step {per_verify:.2f}  "
                    f"per request step: tokens {toks / req_steps:.2f} verified "
                    f"{nodes / req_steps:.2f}  per depth [{rates}]  text == none: {same}"
                )


if __name__ == "__main__":
    main()
