# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Data-parallel scaling: generation throughput of DP = 2 over DP = 1 in one run, on a simulated
2-node Ray cluster (ray.cluster_utils.Cluster, 1 CPU per node: each replica holds one node's
CPU and is pinned to one core) and with the mp backend (one process per replica, one core
each; DP = 1 is the plain in-process engine on one thread). Engines are started in
interleaved order (1, 2, 2, 1, ...), each does a warm-up pass and one timed pass of the same
64 requests; medians over the repeats, the ratio printed last. The CPU share of this process
(the front end; with mp DP = 1 also the engine itself) is printed per run: on 2 cores the
front end competes with the replicas. Greedy tokens of DP = 2 are
checked equal to DP = 1's.

    python -m benchmarks.dp_scaling [--model PATH] [--num-prompts 64] [--repeats 3]
        [--backends ray,mp]

Without --model the bundled model is used. Needs at least 2 cores to mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core per replica (and for DP = 1)

from benchmarks.common import cpu_flags, parse_workload, timer


def _replica_procs(llm) -> list:
    """The replica processes of a data-parallel engine (none for the in-process engine)."""
    import psutil

    replicas = getattr(llm.llm_engine, "replicas", [])
    return [psutil.Process(r.info["pid"]) for r in replicas]


def _cpu_s(procs: list) -> list[float]:
    """CPU seconds (user + system) of each process and its children so far."""
    out = []
    for p in procs:
        total = sum(p.cpu_times()[:2])
        for c in p.children(recursive=True):
            total += sum(c.cpu_times()[:2])
        out.append(total)
    return out


def run(model: str, prompts: list[list[int]], args, dp: int, backend: str) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        data_parallel_size=dp,
        data_parallel_backend=backend if (dp > 1 or backend == "ray") else None,
        disable_log_stats=True,
    )
    start_s = time.perf_counter() - t0
    try:
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], warm, use_tqdm=False)
        replicas = _replica_procs(llm)
        r0 = _cpu_s(replicas)
        c0 = time.process_time()
        with timer() as t:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        front_cpu = time.process_time() - c0
        replica_cpu = [b - a for a, b in zip(r0, _cpu_s(replicas))]
    finally:
        llm.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tok_s": n / t["s"],
        "seconds": t["s"],
        "start_s": start_s,
        "front_cpu": front_cpu,
        "replica_cpu": replica_cpu,
        "ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def bench_backend(model: str, prompts, args, backend: str) -> tuple[float, float]:
    """Median tok/s of DP = 1 and DP = 2, engines started in interleaved order."""
    res: dict[int, list[dict]] = {1: [], 2: []}
    for rep in range(args.repeats):
        for dp in (1, 2) if rep % 2 == 0 else (2, 1):
            r = run(model, prompts, args, dp, backend)
            res[dp].append(r)
            print(
                f"  {backend} DP={dp} repeat {rep}: {r['tok_s']:8.1f} tok/s ({r['seconds']:.2f} s;"
                f" start-up {r['start_s']:.1f} s; this process on a CPU "
                f"{100 * r['front_cpu'] / r['seconds']:.0f}% of the time"
                + "".join(
                    f", replica {i} {100 * c / r['seconds']:.0f}%"
                    for i, c in enumerate(r["replica_cpu"])
                )
                + ")",
                flush=True,
            )
    for r in res[2]:
        if r["ids"] != res[1][0]["ids"]:
            raise SystemExit(f"{backend}: DP = 2 gave other greedy tokens than DP = 1")
    return (
        statistics.median(r["tok_s"] for r in res[1]),
        statistics.median(r["tok_s"] for r in res[2]),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="ray,mp")
    from vllm.config import default_model_path

    args, model, prompts = parse_workload(ap, default_model_path, "bundled model", input_len=32)
    print(f"CPU: {cpu_flags()}; cores available: {len(os.sched_getaffinity(0))}", flush=True)
    try:
        load = os.getloadavg()
        print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    except OSError:
        pass
    print(
        f"model={model} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
        f"repeats={args.repeats} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        flush=True,
    )
    ratios = {}
    for backend in args.backends.split(","):
        if backend == "ray":
            import ray
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
            try:
                cluster.add_node(num_cpus=1)
                cluster.wait_for_nodes()
                ray.init(address=cluster.address, log_to_driver=False)
                print(f"Ray cluster: {len(ray.nodes())} nodes, 1 CPU each", flush=True)
                ratios[backend] = bench_backend(model, prompts, args, backend)
            finally:
                ray.shutdown()
                cluster.shutdown()
        else:
            ratios[backend] = bench_backend(model, prompts, args, backend)
    for backend, (one, two) in ratios.items():
        print(
            f"{backend}: DP=1 {one:.1f} tok/s, DP=2 {two:.1f} tok/s (medians of {args.repeats})",
            flush=True,
        )
    for backend, (one, two) in ratios.items():
        print(f"DP=2 / DP=1 ({backend}): {two / one:.2f}x", flush=True)


if __name__ == "__main__":
    main()
