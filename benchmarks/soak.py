# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Soak: steady load against a real `vllm serve` for a given time, sampling the resident memory
of the API server and of every pipeline stage at intervals. Prints requests/s and each process's
memory growth per minute after warm-up (least-squares slope), so a leak shows as a steady slope.

With --baseline-code DIR the same soak runs first against another checkout's code (e.g. the
main branch before a fix) and the comparison of the growth rates is printed last.

    python benchmarks/soak.py --duration 240                 # bundled model, -pp 2, MTP K=2
    python benchmarks/soak.py --baseline-code /tmp/main-checkout --duration 180
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.common import resolve_model


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return float("nan")
    return 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var


async def _load(
    url: str, model: str, args: argparse.Namespace, stop_at: float, stats: dict
) -> None:
    import httpx

    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, worker: int) -> None:
        while time.monotonic() < stop_at:
            body = {
                "model": model,
                "prompt": [rng.randrange(10, 1000) for _ in range(args.prompt_len)],
                "max_tokens": args.output_len,
                "temperature": 0 if worker % 2 == 0 else 0.8,
                "seed": rng.randrange(2**31),
                "ignore_eos": True,
                "stream": worker % 2 == 1,  # half stream, half wait for the whole answer
            }
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    stats["errors"] += 1
                    await resp.aread()
                    continue
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and "error" in json.loads(line[6:]):
                        stats["errors"] += 1
            stats["requests"] += 1
            stats["tokens"] += args.output_len

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(args.concurrency)))


async def _sample(server, stop_at: float, interval: float, t0: float, out: list) -> None:
    while time.monotonic() < stop_at:
        out.append((time.monotonic() - t0, server.rss_mib()))
        await asyncio.sleep(interval)
    out.append((time.monotonic() - t0, server.rss_mib()))


def soak(args: argparse.Namespace, code_dir: str | None, label: str) -> dict:
    from vllm.testing.remote_server import RemoteServer

    model = resolve_model(args.model) if args.model else ""
    serve_args = ["--max-model-len", str(args.max_model_len), "--disable-uvicorn-access-log"]
    serve_args += ["-pp", str(args.pp)]
    if args.spec_k:
        spec = {"method": "mtp", "num_speculative_tokens": args.spec_k}
        serve_args += ["--speculative-config", json.dumps(spec)]
    env = {"OMP_NUM_THREADS": "1"}
    cwd = None
    if code_dir:
        # `python -m` puts the working directory first on sys.path: run from the checkout.
        cwd = str(Path(code_dir).resolve())
        env["PYTHONPATH"] = cwd
    log = Path(tempfile.gettempdir()) / f"vllm-soak-{label.replace(' ', '-')}.log"
    srv = RemoteServer(model, serve_args, log, env=env, cwd=cwd)  # "" = the bundled model
    try:
        srv.wait_ready(timeout=600)
        import httpx

        served = httpx.get(srv.url("/v1/models")).json()["data"][0]["id"]
        code = httpx.get(srv.url("/version")).json()
        print(f"[{label}] serving {served} ({code}) from {cwd or 'this checkout'}", flush=True)
        stats = {"requests": 0, "tokens": 0, "errors": 0}
        samples: list = []
        t0 = time.monotonic()
        stop_at = t0 + args.duration

        async def run() -> None:
            await asyncio.gather(
                _load(srv.url("/v1/completions"), served, args, stop_at, stats),
                _sample(srv, stop_at, args.interval, t0, samples),
            )

        asyncio.run(run())
        elapsed = time.monotonic() - t0
    finally:
        rc = srv.stop(timeout=60)
    after = [(t, m) for t, m in samples if t >= args.warmup]
    procs = sorted(samples[0][1]) if samples else []
    growth = {p: slope_per_minute([(t, m[p]) for t, m in after]) for p in procs}
    first = after[0][1] if after else {}
    last = after[-1][1] if after else {}
    return {
        "label": label,
        "elapsed": elapsed,
        "rps": stats["requests"] / elapsed,
        "tok_s": stats["tokens"] / elapsed,
        "errors": stats["errors"],
        "requests": stats["requests"],
        "growth": growth,
        "first": first,
        "last": last,
        "exit": rc,
    }


def report(r: dict) -> None:
    print(
        f"\n[{r['label']}] {r['requests']} requests in {r['elapsed']:.0f} s: "
        f"{r['rps']:.2f} req/s, {r['tok_s']:.1f} output tok/s, {r['errors']} errors, "
        f"server exit code {r['exit']}"
    )
    print(f"{'process':<12} {'RSS after warm-up':>18} {'RSS at end':>11} {'growth MiB/min':>15}")
    for p, g in r["growth"].items():
        first, last = r["first"].get(p, math.nan), r["last"].get(p, math.nan)
        print(f"{p:<12} {first:>14.1f} MiB {last:>7.1f} MiB {g:>15.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="", help="model folder or 'tiny' (default: bundled model)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--spec-k", type=int, default=2, help="MTP draft tokens (0: no speculation)")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of load per run")
    ap.add_argument("--warmup", type=float, default=45.0, help="seconds before growth is measured")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--baseline-code", default=None, help="checkout to soak first, for comparison")
    args = ap.parse_args()
    results = []
    if args.baseline_code:
        results.append(soak(args, args.baseline_code, "baseline"))
        report(results[-1])
    results.append(soak(args, None, "this checkout"))
    report(results[-1])
    if len(results) == 2:
        base, new = results
        print("\nmemory growth after warm-up, MiB/min (baseline -> this checkout):")
        for p in new["growth"]:
            b, n = base["growth"].get(p, math.nan), new["growth"][p]
            print(f"  {p:<12} {b:8.2f} -> {n:8.2f}")
        print(
            f"requests/s: {base['rps']:.2f} -> {new['rps']:.2f} ({new['rps'] / base['rps']:.2f}x)"
        )


if __name__ == "__main__":
    main()
