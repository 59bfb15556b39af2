# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`vllm bench serve`: load a running OpenAI-compatible server (vLLM's flags) and report
throughput and TTFT / TPOT / ITL / E2E latency percentiles, as vLLM's benchmark does; beyond
it, the server's speculative-decoding acceptance over the run, read from its /metrics.

    vllm bench serve --backend openai --base-url http://127.0.0.1:8000 --dataset-name random \
        --random-input-len 128 --random-output-len 64 --num-prompts 32 --max-concurrency 8

Token counts are the server's own (each request asks for its usage); the dataset's lengths are
used only for a request that reported none. Heavy imports happen when a run starts, so
building the `vllm` command line stays fast."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

_METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)"}
_METRICS |= {"itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's `bench serve` flags (the subset this benchmark implements)."""
    add = parser.add_argument
    add("--backend", choices=["openai", "openai-chat"], default="openai")
    add("--base-url", default=None, help="Server URL (default: http://HOST:PORT)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default=None, help="Default: /v1/completions (openai-chat: /v1/chat/...)")
    add("--model", default=None, help="Model name sent (default: the server's first model)")
    add("--tokenizer", default=None, help="Tokenizer folder (default: --model)")
    add("--served-model-name", default=None, help="Name sent as `model` (default: --model)")
    add("--dataset-name", choices=["random", "custom"], default="random")
    add("--dataset-path", default=None, help='custom: a JSONL file of {"prompt": ...} lines')
    add("--custom-output-len", type=int, default=256, help="custom: max_tokens per request")
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=128)
    add("--num-prompts", type=int, default=1000)
    add("--max-concurrency", type=int, default=None, help="Most requests in flight")
    add("--request-rate", type=float, default=float("inf"), help="Requests/s (inf: all at once)")
    add("--burstiness", type=float, default=1.0, help="Gamma shape of arrivals (1: Poisson)")
    add("--seed", type=int, default=0)
    add("--ignore-eos", action="store_true", help="Send ignore_eos (every answer is full)")
    add("--temperature", type=float, default=0.0, help="Sampling temperature sent")
    add("--save-result", action="store_true", help="Write the results as JSON")
    add("--result-dir", default=None)
    add("--result-filename", default=None)
    add("--percentile-metrics", default="ttft,tpot,itl", help="Of ttft, tpot, itl, e2el")
    add("--metric-percentiles", default="99", help="Comma-separated percentiles, e.g. 50,90,99")
    add("--disable-tqdm", action="store_true", help="Accepted for vLLM compatibility")
    return parser


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""


# ------------------------------------------------------------------------------- datasets


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def random_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    """--random-input-len random token ids per prompt (clear of the low ids where tokenizers
    keep their special tokens); completions send the ids themselves (exact lengths), chat the
    text they decode to."""
    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    low = min(100, vocab // 2)
    out = []
    for _ in range(args.num_prompts):
        ids = [rng.randrange(low, vocab) for _ in range(args.random_input_len)]
        prompt: str | list[int] = ids if args.backend == "openai" else tokenizer.decode(ids)
        out.append(BenchRequest(prompt, len(ids), args.random_output_len))
    return out


def custom_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    if not args.dataset_path:
        raise ValueError("--dataset-name custom needs --dataset-path (a JSONL file)")
    out = []
    with open(args.dataset_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise ValueError(f'{args.dataset_path}:{n}: expected {{"prompt": "..."}}')
            prompt_len = len(tokenizer.encode(item["prompt"]))
            out.append(BenchRequest(item["prompt"], prompt_len, args.custom_output_len))
            if len(out) == args.num_prompts:
                break
    if not out:
        raise ValueError(f"{args.dataset_path} has no prompts")
    return out


# --------------------------------------------------------------------------------- requests


def _payload(args: argparse.Namespace, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(client: Any, url: str, body: dict[str, Any], req: BenchRequest):
    """One streamed request, timed per chunk (TTFT = first chunk with text, ITL = the gaps
    between later ones), with the server's usage."""
    res = RequestResult(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"].get("message"))
                    return res
                now = time.perf_counter()
                for choice in data.get("choices") or ():
                    piece = choice.get("text")
                    if piece is None:
                        piece = (choice.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    if not res.text and not res.ttft:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += piece
                usage = data.get("usage")
                if usage:
                    res.prompt_len = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.success = True
    except Exception as e:  # noqa: BLE001 - one failed request is counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield request indices at the given rate (gamma-distributed gaps, as vLLM)."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def run_requests(args: argparse.Namespace, url: str, model: str, reqs: list[BenchRequest]):
    import httpx

    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=args.max_concurrency or max(len(reqs), 1))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def one(req: BenchRequest) -> RequestResult:
            body = _payload(args, model, req)
            if sem is None:
                return await send_request(client, url, body, req)
            async with sem:
                return await send_request(client, url, body, req)

        tasks = []
        start = time.perf_counter()
        async for i in _arrivals(len(reqs), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.ensure_future(one(reqs[i])))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ---------------------------------------------------------------------------------- metrics


def spec_decode_counters(base_url: str) -> dict[str, Any] | None:
    """The server's vllm:spec_decode_* counters (summed over labels; absent ones are 0), or
    None when /metrics cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(s.labels["position"])
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + s.value
    return out


def spec_decode_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Acceptance over the run (after - before); None when the server drafted nothing."""
    if before is None or after is None:
        return None
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [
        after["per_pos"].get(i, 0.0) - before["per_pos"].get(i, 0.0)
        for i in range(len(after["per_pos"]))
    ]
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_num_draft_tokens": int(draft_tokens),
        "spec_decode_num_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1 + accepted / drafts,
        "spec_decode_per_position_acceptance_rate": [v / drafts for v in per_pos],
    }


def calculate_metrics(
    results: list[RequestResult], duration: float, metrics: list[str], percentiles: list[float]
) -> dict[str, Any]:
    import numpy as np

    ok = [r for r in results if r.success]
    values: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    res: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    }
    for m in metrics:
        xs = np.asarray(values[m] or [0.0]) * 1000
        res[f"mean_{m}_ms"] = float(xs.mean())
        res[f"median_{m}_ms"] = float(np.median(xs))
        res[f"std_{m}_ms"] = float(xs.std())
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            res[f"p{word}_{m}_ms"] = float(np.percentile(xs, p))
    return res


# ------------------------------------------------------------------------------------- main


def _check(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    for name in ("num_prompts", "random_input_len", "random_output_len", "custom_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in _METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {list(_METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles must be numbers, got {args.metric_percentiles!r}"
        ) from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {percentiles}")
    return metrics, percentiles


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    metrics, percentiles = _check(args)
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    model = args.model
    if model is None:
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    tokenizer = load_tokenizer(args.tokenizer or args.model or model)
    make = random_requests if args.dataset_name == "random" else custom_requests
    reqs = make(args, tokenizer)
    spec_before = spec_decode_counters(base)
    results, duration = asyncio.run(
        run_requests(args, base + endpoint, args.served_model_name or model, reqs)
    )
    res = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": len(reqs),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **calculate_metrics(results, duration, metrics, percentiles),
    }
    spec = spec_decode_delta(spec_before, spec_decode_counters(base))
    if spec is not None:
        res.update(spec)
    report(res, metrics, percentiles)
    if args.save_result:
        name = args.result_filename or f"{args.backend}-{res['date']}.json"
        path = f"{args.result_dir}/{name}" if args.result_dir else name
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
    return res


def report(res: dict[str, Any], metrics: list[str], percentiles: list[float]) -> None:
    line = "{:<40} {:<10}"
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    print(line.format("Successful requests:", res["completed"]))
    print(line.format("Benchmark duration (s):", f"{res['duration']:.2f}"))
    print(line.format("Total input tokens:", res["total_input_tokens"]))
    print(line.format("Total generated tokens:", res["total_output_tokens"]))
    print(line.format("Request throughput (req/s):", f"{res['request_throughput']:.2f}"))
    print(line.format("Output token throughput (tok/s):", f"{res['output_throughput']:.2f}"))
    print(line.format("Total Token throughput (tok/s):", f"{res['total_token_throughput']:.2f}"))
    for m in metrics:
        name = m.upper() if m != "e2el" else "E2EL"
        print("{s:{c}^50}".format(s=_METRICS[m], c="-"))
        print(line.format(f"Mean {name} (ms):", f"{res[f'mean_{m}_ms']:.2f}"))
        print(line.format(f"Median {name} (ms):", f"{res[f'median_{m}_ms']:.2f}"))
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            print(line.format(f"P{word} {name} (ms):", f"{res[f'p{word}_{m}_ms']:.2f}"))
    if "spec_decode_acceptance_rate" in res:
        print("{s:{c}^50}".format(s="Speculative Decoding (server)", c="-"))
        print(
            line.format("Acceptance rate (%):", f"{100 * res['spec_decode_acceptance_rate']:.2f}")
        )
        print(line.format("Acceptance length:", f"{res['spec_decode_acceptance_length']:.2f}"))
        print(line.format("Drafts:", res["spec_decode_num_drafts"]))
        print(line.format("Draft tokens:", res["spec_decode_num_draft_tokens"]))
        print(line.format("Accepted tokens:", res["spec_decode_num_accepted_tokens"]))
        rates = ", ".join(f"{r:.3f}" for r in res["spec_decode_per_position_acceptance_rate"])
        print(line.format("Per-position acceptance rate:", rates))
    failed = [e for e in res["errors"] if e]
    if failed:
        print(f"Failed requests: {len(failed)} (first: {failed[0]})")
    print("=" * 50)


def main(args: argparse.Namespace) -> int:
    res = run(args)
    return 0 if res["completed"] == res["num_prompts"] else 1
