# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Hybrid (Qwen3.5: Gated DeltaNet + full attention) prefix caching on vs off: TTFT of a prompt
with a long prefix seen before, in one run on the same machine, the ratio printed last.

Per repeat, on a reset cache: two warm-up requests (prefix + tail 0, prefix + tail 1: the
second leaves a checkpoint where the shared prefix ends), then timed alone:
- "repeat": prefix + tail 0 again (resumes at its last checkpointed block boundary);
- "shared": prefix + a new tail (resumes at the end of the shared prefix).
Outputs (greedy) are checked equal between on and off.

    python benchmarks/hybrid_prefix_cache.py --prefix-len 1536 --tail-len 24 --repeats 3

--multi-turn: chats whose turns are shorter than a block, with and without the prompt-tail
cache (mamba_cache_prompt_tail): each session starts from its own system prefix; every turn's
prompt is the previous prompt + the previous answer + a new user message. Hit rate (cached /
prompt tokens over turns 2..T) and the median TTFT of those turns, both engines interleaved by
session, outputs checked equal.

    python benchmarks/hybrid_prefix_cache.py --multi-turn --prefix-len 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_flags


def build_model(folder: Path, hidden: int, layers: int, max_len: int) -> str:
    """A modest random Qwen3.5 (3 linear-attention layers per full-attention one)."""
    from vllm.testing import qwen3_5_checkpoints as q35

    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    path = q35.make_qwen3_5(folder, hidden_size=hidden, layer_types=types)
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["max_position_embeddings"] = max_len
    cfg_file.write_text(json.dumps(cfg))
    return path


def ttft(llm, prompt: list[int], output_len: int) -> tuple[float, list[int], int]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rid = f"t{time.perf_counter_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    first = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs[0].token_ids:
                first = time.perf_counter() - start
            if o.finished:
                out = o
    assert first is not None and out is not None
    return first, list(out.outputs[0].token_ids), out.num_cached_tokens


def multi_turn(args, model: str, vocab: int, common: dict) -> None:
    from vllm import LLM

    g = torch.Generator().manual_seed(1)

    def rand(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    sessions = [
        (rand(args.prefix_len), [rand(args.user_len) for _ in range(args.turns)])
        for _ in range(args.sessions)
    ]
    print(
        f"multi-turn: {args.sessions} sessions x {args.turns} turns; system prefix "
        f"{args.prefix_len}, user messages {args.user_len}, answers {args.output_len} tokens "
        f"(a turn adds {args.user_len + args.output_len} < block {args.block_size})"
    )
    llms = {
        "no tail": LLM(mamba_cache_prompt_tail=False, **common),
        "tail": LLM(**common),
    }
    times: dict[str, list[float]] = {n: [] for n in llms}
    hit: dict[str, list[int]] = {n: [0, 0] for n in llms}  # cached, prompt tokens (turns 2..)
    pairs: list[float] = []  # per turn: TTFT without / with, run back to back
    try:
        for llm in llms.values():  # warm-up: first-request costs out of the timings
            for n in (args.prefix_len, args.user_len + 1):
                ttft(llm, rand(n), args.output_len)
        for rep in range(args.repeats):
            for llm in llms.values():
                if not llm.reset_prefix_cache():
                    raise RuntimeError("the prefix cache could not be reset")
            for si, (system, users) in enumerate(sessions):
                prompt: list[int] = list(system)
                for ti, user in enumerate(users):
                    prompt = prompt + user
                    # Turn by turn, both engines back to back, the order alternating.
                    order = list(llms) if (rep + si + ti) % 2 == 0 else list(llms)[::-1]
                    got = {}
                    for name in order:
                        t, toks, n_cached = ttft(llms[name], prompt, args.output_len)
                        got[name] = toks
                        if ti > 0:
                            times[name].append(t)
                            hit[name][0] += n_cached
                            hit[name][1] += len(prompt)
                    assert got["tail"] == got["no tail"], "outputs differ"
                    if ti > 0:
                        pairs.append(times["no tail"][-1] / times["tail"][-1])
                    prompt = prompt + got["tail"]
                print(
                    f"repeat {rep} session {si}: "
                    + ", ".join(f"{n} {statistics.median(times[n]) * 1e3:.1f} ms" for n in llms)
                )
    finally:
        for llm in llms.values():
            llm.shutdown()
    print("| prompt-tail cache | cached / prompt tokens (turns 2..) | hit rate | TTFT (ms) |")
    print("|---|---|---|---|")
    for name in llms:
        c, n = hit[name]
        print(
            f"| {'on' if name == 'tail' else 'off'} | {c} / {n} | {c / n:.1%} | "
            f"{statistics.median(times[name]) * 1e3:.1f} |"
        )
    ratio = statistics.median(times["no tail"]) / statistics.median(times["tail"])
    print(
        f"TTFT speed-up of the prompt-tail cache (without / with): {ratio:.2f}x of the "
        f"medians, {statistics.median(pairs):.2f}x median of the per-turn pairs"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--multi-turn", action="store_true")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-len", type=int, default=7)
    ap.add_argument("--prefix-len", type=int, default=1536)
    ap.add_argument("--tail-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from vllm import LLM

    max_len = args.prefix_len + args.tail_len + args.output_len + 64
    if args.multi_turn:
        max_len = args.prefix_len + args.turns * (args.user_len + args.output_len) + 64
    tmp = tempfile.TemporaryDirectory()
    model = build_model(Path(tmp.name), args.hidden, args.layers, max_len)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, vocab, (args.prefix_len,), generator=g).tolist()
    tails = [torch.randint(1, vocab, (args.tail_len,), generator=g).tolist() for _ in range(3)]
    warm = [prefix + tails[0], prefix + tails[1]]
    timed = {"repeat": prefix + tails[0], "shared": prefix + tails[2]}
    common = dict(
        model=model,
        dtype="float32",
        max_model_len=max_len,
        block_size=args.block_size,
        max_num_seqs=4,
    )
    print(f"CPU: {cpu_flags()}; torch threads {torch.get_num_threads()}")
    if args.multi_turn:
        print(
            f"model: Qwen3.5 hidden {args.hidden}, {args.layers} layers (3:1 linear:full), "
            f"block {args.block_size}"
        )
        try:
            multi_turn(args, model, vocab, common)
        finally:
            tmp.cleanup()
        return
    print(
        f"model: Qwen3.5 hidden {args.hidden}, {args.layers} layers (3:1 linear:full); prefix "
        f"{args.prefix_len} + tail {args.tail_len} tokens, block {args.block_size}"
    )
    llms = {
        "off": LLM(enable_prefix_caching=False, **common),
        "on": LLM(enable_prefix_caching=True, **common),
    }
    times: dict[tuple[str, str], list[float]] = {}
    outs: dict[tuple[str, str], list[int]] = {}
    cached: dict[tuple[str, str], int] = {}
    try:
        for rep in range(args.repeats):
            for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                llm = llms[name]
                if not llm.reset_prefix_cache():
                    raise RuntimeError("the prefix cache could not be reset")
                for p in warm:
                    ttft(llm, p, args.output_len)
                for kind, p in timed.items():
                    t, toks, n_cached = ttft(llm, p, args.output_len)
                    times.setdefault((name, kind), []).append(t)
                    outs[(name, kind)], cached[(name, kind)] = toks, n_cached
                    print(
                        f"repeat {rep} {name:3s} {kind}: TTFT {t * 1e3:.1f} ms, {n_cached} cached"
                    )
    finally:
        for llm in llms.values():
            llm.shutdown()
        tmp.cleanup()
    for kind in timed:
        assert outs[("on", kind)] == outs[("off", kind)], f"{kind}: outputs differ"
    print("| prompt | TTFT off (ms) | TTFT on (ms) | cached tokens (on) | speed-up |")
    print("|---|---|---|---|---|")
    ratios = []
    for kind in timed:
        off = statistics.median(times[("off", kind)])
        on = statistics.median(times[("on", kind)])
        ratios.append(off / on)
        print(
            f"| {kind} | {off * 1e3:.1f} | {on * 1e3:.1f} | {cached[('on', kind)]} | "
            f"{off / on:.2f}x |"
        )
    print(
        f"TTFT speed-up with prefix caching (off / on): repeat {ratios[0]:.2f}x, "
        f"shared prefix {ratios[1]:.2f}x"
    )


if __name__ == "__main__":
    main()
