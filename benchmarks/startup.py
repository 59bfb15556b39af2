# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Start-up time by phase: a fresh process from launch to `LLM(...)` returning, and `vllm serve`
from launch to its first answered request, for SmolLM2 and the bundled model; with
--baseline-code DIR the same runs with another checkout's code (e.g. main), interleaved.

Each run is its own process (imports, kernels' library load and all). Phases come from the
engine's log: this checkout's "Start-up: engine ready in ... (tokenizer, load, pools,
warm-up, step costs)" line; older code's "Warm-up: ... in X s" / "Step costs ... (X s)" lines.
"config" is from the launch to the engine's first phase (interpreter, imports, reading the
checkpoint's config). Medians over --repeats; the CPU's flags and the load average are printed
(the machine is shared: compare rows of the same run).

    python benchmarks/startup.py [--models smollm2 bundled bundled-mtp-pp2] [--repeats 3]
        [--baseline-code /path/to/main/checkout] [--serve] [--num-threads N] [--timeout-s 900]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_flags  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.time()
from vllm import LLM
from vllm.model_zoo import smollm2_path
t_import = time.time()
kw = json.loads(sys.argv[1])
if kw.pop("smollm2", False):
    kw["model"] = smollm2_path()
t1 = time.time()
llm = LLM(**kw)
t2 = time.time()
print("READY", json.dumps({"t0": t0, "import": t_import - t0, "llm": t2 - t1}), flush=True)
llm.shutdown()
"""

MODELS = {
    "smollm2": {"smollm2": True},
    "bundled": {},
    "bundled-mtp-pp2": {
        "pipeline_parallel_size": 2,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
    },
}


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def parse_phases(log: str) -> dict[str, float]:
    phases: dict[str, float] = {}
    m = re.search(r"Start-up: engine ready in ([\d.]+) s \((.*?)\)", log)
    if m:
        for part in m.group(2).split(", "):
            name, _, val = part.rpartition(" ")[0].rpartition(" ")
            phases[name.strip() or part.split(" ")[0]] = float(val)
        phases["engine total"] = float(m.group(1))
        return phases
    m = re.search(r"Warm-up: .*? in ([\d.]+) s", log)
    if m:
        phases["warm-up"] = float(m.group(1))
    m = re.search(r"Step costs for the adaptive K \(([\d.]+) s\)", log)
    if m:
        phases["step costs"] = float(m.group(1))
    return phases


def run_llm(code: Path, model: str, env: dict, timeout: float) -> dict:
    env = dict(env, PYTHONPATH=str(code))
    t_launch = time.time()
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(MODELS[model])],
            cwd=str(code),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"ready_s": None, "note": f"> {timeout:.0f} s (killed)"}
    out = p.stdout + p.stderr
    m = re.search(r"READY (\{.*\})", out)
    if not m:
        return {"ready_s": None, "note": "failed: " + " ".join(out.split())[-300:]}
    info = json.loads(m.group(1))
    res = {"ready_s": info["t0"] - t_launch + info["import"] + info["llm"]}
    phases = parse_phases(out)
    # Launch to the engine's first phase: interpreter, imports, the checkpoint's config.
    engine = phases.get("engine total")
    if engine is not None:
        phases = {"config": res["ready_s"] - engine, **phases}
    res["phases"] = phases
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(code: Path, model_path: str, env: dict, timeout: float) -> dict:
    """Launch `vllm serve` and time its first answered completion request."""
    port = free_port()
    env = dict(env, PYTHONPATH=str(code))
    cli = "vllm.entrypoints.cli.main"
    cmd = [sys.executable, "-m", cli, "serve", model_path, "--port", str(port)]
    t_launch = time.time()
    proc = subprocess.Popen(
        cmd, cwd=str(code), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    body = json.dumps({"model": model_path, "prompt": "Hello", "max_tokens": 1}).encode()
    try:
        while time.time() - t_launch < timeout:
            if proc.poll() is not None:
                return {"ready_s": None, "note": f"exited {proc.returncode}"}
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    r.read()
                return {"ready_s": time.time() - t_launch}
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)  # not up yet: poll again
        return {"ready_s": None, "note": f"> {timeout:.0f} s"}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def fmt(runs: list[dict]) -> str:
    ok = [r["ready_s"] for r in runs if r.get("ready_s") is not None]
    if not ok:
        return runs[-1].get("note", "failed")
    s = f"{statistics.median(ok):.1f} s"
    if len(ok) < len(runs):
        s += f" ({len(runs) - len(ok)} failed: {runs[-1].get('note', '')})"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "bundled", "bundled-mtp-pp2"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-code", type=Path, default=None)
    ap.add_argument("--serve", action="store_true", help="also time `vllm serve` (SmolLM2)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    env = dict(os.environ)
    if args.num_threads:
        env["OMP_NUM_THREADS"] = str(args.num_threads)
    codes = {"after": ROOT}
    if args.baseline_code is not None:
        codes = {"before": args.baseline_code.resolve(), "after": ROOT}
    print(f"CPU: {cpu_flags()}; OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}")
    print(f"load average at start {load_avg()} (shared machine)")
    from vllm.model_zoo import smollm2_path

    smol = smollm2_path()  # converted once, outside the timings
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for model in args.models + (["serve-smollm2"] if args.serve else []):
            for name, code in codes.items():
                if model == "serve-smollm2":
                    r = run_serve(code, smol, env, args.timeout_s)
                else:
                    r = run_llm(code, model, env, args.timeout_s)
                results.setdefault((model, name), []).append(r)
                print(
                    f"  repeat {rep} {model} {name}: "
                    + (f"{r['ready_s']:.1f} s" if r.get("ready_s") else r.get("note", ""))
                    + (f" {r.get('phases')}" if r.get("phases") else "")
                    + f" (load {load_avg()})",
                    flush=True,
                )
    print("\n| model | code | ready after launch (median) | phases (median s) |")
    print("|---|---|---|---|")
    for (model, name), runs in results.items():
        keys: list[str] = []
        for r in runs:
            keys += [k for k in r.get("phases", {}) if k not in keys]
        med = {
            k: statistics.median([r["phases"][k] for r in runs if k in r.get("phases", {})])
            for k in keys
        }
        ph = ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        print(f"| {model} | {name} | {fmt(runs)} | {ph} |")
    print(f"\nload average at end {load_avg()}")


if __name__ == "__main__":
    main()
