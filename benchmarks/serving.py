# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Online serving: N concurrent streaming clients against `vllm serve` (started here) vs offline
`LLM.generate` on the same prompts and model, in one run. Prints requests/s, output tokens/s,
TTFT and inter-token latency percentiles per concurrency, then the server-overhead ratio last.

    python benchmarks/serving.py                      # tiny random llama
    python benchmarks/serving.py --model smollm2 --concurrency 1 8 32 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.common import resolve_model, timer


@dataclass
class RequestResult:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_tokens: int = 0
    latency: float = 0.0


def percentiles(values: list[float], ps=(50, 90, 99)) -> list[float]:
    if not values:
        return [float("nan")] * len(ps)
    s = sorted(values)
    return [s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))] for p in ps]


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult()
    start = last = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                res.num_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            if res.ttft == 0.0:
                res.ttft = now - start
            else:
                res.itls.append(now - last)
            last = now
    res.latency = time.perf_counter() - start
    return res


async def run_level(
    base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[float, list[RequestResult]]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await one_request(client, url, model, prompts[0], 2)  # warm-up

        async def bounded(p):
            async with sem:
                return await one_request(client, url, model, p, output_len)

        with timer() as t:
            results = await asyncio.gather(*(bounded(p) for p in prompts))
    return t["s"], results


def make_prompts(vocab_size: int, n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids, where the tiny tokenizers keep their special tokens.
    return [[rng.randrange(16, vocab_size) for _ in range(input_len)] for _ in range(n)]


def offline_throughput(model: str, prompts, output_len: int, max_num_seqs: int, dtype: str):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs)
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with timer() as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return len(prompts) / t["s"], n / t["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | a model folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per concurrency level (default: 2 x concurrency, min 4)",
    )
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoConfig

    from vllm.testing.remote_server import RemoteServer

    model = resolve_model(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    top = max(args.concurrency)
    levels = {c: args.num_prompts or max(4, 2 * c) for c in args.concurrency}
    prompts = make_prompts(vocab, max(levels.values()), args.input_len, args.seed)
    print(
        f"model={args.model} dtype={args.dtype} input_len={args.input_len} "
        f"output_len={args.output_len}"
    )

    log = Path(tempfile.gettempdir()) / "vllm-bench-serving.log"
    server = RemoteServer(
        model,
        [
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(top),
            "--disable-log-stats",
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
        ],
        log_path=log,
    )
    online: dict[int, tuple[float, float]] = {}
    try:
        server.wait_ready()
        header = (
            f"{'conc':>4} {'reqs':>5} {'req/s':>7} {'tok/s':>8} "
            f"{'TTFT p50/p90/p99 (ms)':>24} {'ITL p50/p90/p99 (ms)':>24}"
        )
        print(header)
        for c, n in levels.items():
            wall, results = asyncio.run(
                run_level(server.base_url, model, prompts[:n], args.output_len, c)
            )
            toks = sum(r.num_tokens for r in results)
            ttft = percentiles([1000 * r.ttft for r in results])
            itl = percentiles([1000 * x for r in results for x in r.itls])
            online[c] = (n / wall, toks / wall)
            print(
                f"{c:>4} {n:>5} {n / wall:>7.2f} {toks / wall:>8.1f} "
                f"{'/'.join(f'{v:.0f}' for v in ttft):>24} "
                f"{'/'.join(f'{v:.0f}' for v in itl):>24}"
            )
    finally:
        server.stop(timeout=60)

    n_top = levels[top]
    req_s, tok_s = offline_throughput(model, prompts[:n_top], args.output_len, top, args.dtype)
    print(
        f"offline LLM.generate ({n_top} prompts, max_num_seqs={top}): "
        f"{req_s:.2f} req/s, {tok_s:.1f} tok/s"
    )
    srv_tok_s = online[top][1]
    print(
        f"server overhead ratio (offline tok/s / server tok/s at concurrency {top}): "
        f"{tok_s / srv_tok_s:.2f}x"
    )


if __name__ == "__main__":
    main()
