# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Prefix caching on vs off: requests that share a long system prompt (each with its own short
user turn) arrive at a fixed rate; prints TTFT p50/p90, output and total tokens/s and the prefix
cache hit rate of each setting, with on/off runs interleaved (medians over repeats; the cache is
reset before every run, so each run's first request misses), and the on/off ratios last.

    python benchmarks/prefix_caching.py --model smollm2 --system-len 512 --user-len 32 \
        --num-requests 16 --output-len 16 --rate 4 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import resolve_model


def _counter(llm, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def run_once(llm, prompts: list[list[int]], output_len: int, rate: float) -> dict[str, float]:
    """Requests arrive every 1/rate s (all at once when rate <= 0); returns latency stats."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset")
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    q0 = _counter(llm, "vllm:prefix_cache_queries")
    h0 = _counter(llm, "vllm:prefix_cache_hits")
    gap = 1.0 / rate if rate > 0 else 0.0
    start = time.perf_counter()
    arrivals = [start + i * gap for i in range(len(prompts))]
    ttft: dict[str, float] = {}
    tokens = 0
    nxt = 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(prompts) and arrivals[nxt] <= now:
            engine.add_request(f"r{nxt}", {"prompt_token_ids": prompts[nxt]}, sp)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - time.perf_counter()))
            continue
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - arrivals[int(out.request_id[1:])]
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    values = sorted(ttft.values())
    queries = _counter(llm, "vllm:prefix_cache_queries") - q0
    hits = _counter(llm, "vllm:prefix_cache_hits") - h0
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "ttft_p50": statistics.median(values),
        "ttft_p90": values[min(len(values) - 1, int(0.9 * len(values)))],
        "out_tok_s": tokens / wall,
        "total_tok_s": (tokens + prompt_tokens) / wall,
        "hit_rate": hits / queries if queries else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | PATH")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (<= 0: all at once)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from transformers import AutoConfig

    from vllm import LLM, SamplingParams

    model = resolve_model(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    g = torch.Generator().manual_seed(0)
    system = torch.randint(10, vocab - 1, (args.system_len,), generator=g).tolist()
    prompts = [
        system + torch.randint(10, vocab - 1, (args.user_len,), generator=g).tolist()
        for _ in range(args.num_requests)
    ]
    common = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=args.system_len + args.user_len + args.output_len + 16,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    llms = {
        "off": LLM(enable_prefix_caching=False, **common),
        "on": LLM(enable_prefix_caching=True, **common),
    }
    outputs = {}
    for name, llm in llms.items():  # warm-up, and the outputs to compare
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], sp, use_tqdm=False)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for rep in range(args.repeats):
        for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            r = run_once(llms[name], prompts, args.output_len, args.rate)
            results[name].append(r)
            print(f"repeat {rep} {name:3s}: " + "  ".join(f"{k} {v:.4g}" for k, v in r.items()))
    for llm in llms.values():
        llm.shutdown()
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for name, rs in results.items()
    }
    print(
        f"model={args.model} system={args.system_len} user={args.user_len} "
        f"requests={args.num_requests} out={args.output_len} rate={args.rate}/s "
        f"repeats={args.repeats} identical outputs: {outputs['on'] == outputs['off']}"
    )
    for name in ("off", "on"):
        m = med[name]
        print(
            f"caching {name:3s}: TTFT p50 {1e3 * m['ttft_p50']:8.1f} ms  p90 "
            f"{1e3 * m['ttft_p90']:8.1f} ms  output {m['out_tok_s']:7.1f} tok/s  total "
            f"{m['total_tok_s']:8.1f} tok/s  hit rate {100 * m['hit_rate']:5.1f}%"
        )
    on, off = med["on"], med["off"]
    print(
        f"ratio on/off: TTFT p50 {on['ttft_p50'] / off['ttft_p50']:.2f}x, "
        f"p90 {on['ttft_p90'] / off['ttft_p90']:.2f}x, "
        f"output tok/s {on['out_tok_s'] / off['out_tok_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
