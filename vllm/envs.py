# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Every environment variable the engine and the server read, in one place.

Each is read when accessed (`vllm.envs.VLLM_PP_STEP_TIMEOUT_S`), so a test or a launcher that
sets one before starting an engine is honoured. An empty value counts as unset; a malformed one
raises ValueError naming the variable. `python -m vllm.envs` prints them all with their docs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


@dataclass(frozen=True)
class EnvVar:
    """One variable: its default (when unset or empty), how its text becomes a value, and what
    it is for."""

    name: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(self.name, raw)


def _positive_float(unit: str) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive number of {unit}, got {raw!r}")
        return value

    return parse


def _choice(*choices: str, upper: bool = False) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().upper() if upper else raw.strip().lower()
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {raw!r}")
        return value

    return parse


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _fault_spec(name: str, raw: str) -> tuple[int, str, int]:
    parts = raw.strip().split(":")
    try:
        rank, marker, n = int(parts[0]), parts[1], int(parts[2])
        if len(parts) != 3 or rank < 0 or n <= 0 or not marker:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"{name} must be RANK:MARKER:N, got {raw!r}") from None
    return rank, marker, n


def _cpu_bind(name: str, raw: str) -> str | list[list[int]]:
    value = raw.strip().lower()
    if value in ("auto", "none"):
        return value
    out: list[list[int]] = []
    try:
        for part in value.split("|"):
            cores: list[int] = []
            for item in part.split(","):
                lo, dash, hi = item.strip().partition("-")
                a = int(lo)
                b = int(hi) if dash else a  # "0-" is malformed, not core 0
                if a < 0 or b < a:
                    raise ValueError
                cores += range(a, b + 1)
            out.append(sorted(set(cores)))
    except ValueError:
        raise ValueError(
            f"{name} must be 'auto', 'none' or '|'-separated core lists like '0-3|4-7', got {raw!r}"
        ) from None
    return out


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false, yes/no, on/off), got {raw!r}")


_VARS = [
    EnvVar(
        "VLLM_PP_STEP_TIMEOUT_S",
        # 120 s is far above any legitimate step seen on CPU (a full 2048-token prefill of
        # SmolLM2-135M on one core takes a few seconds; the first CUDA step's kernel compiles
        # well under a minute) and below VLLM_PP_COMM_TIMEOUT_S, which would otherwise end the
        # wait.
        120.0,
        _positive_float("seconds"),
        "A step (or an idle liveness ping) that no pipeline stage answers within this many "
        "seconds means a stage hangs (stopped, deadlocked, wedged device): the engine then "
        "fails every request and stops all stages. Stages that used CPU time meanwhile are "
        "slow, not hung (a loaded machine): the engine waits another period.",
    ),
    EnvVar(
        "VLLM_PP_COMM_TIMEOUT_S",
        300.0,
        _positive_float("seconds"),
        "Timeout of the torch.distributed collectives between pipeline stages: a peer that "
        "died or hangs makes the op raise, never block forever. The engine notices a dead "
        "stage much sooner (process sentinels, actor liveness); this is the backstop for the "
        "stage processes themselves, and it bounds one stage's wait for a slow step.",
    ),
    EnvVar(
        "VLLM_PP_LAYER_PARTITION",
        None,
        _text,
        "Decoder layers per pipeline stage as a comma list ('3,1'): pipeline_parallel_size "
        "entries, each >= 1, summing to the model's layer count. Unset: an even split whose "
        "remainder goes to stages -2, -3, ... (never the last).",
    ),
    EnvVar(
        "VLLM_WORKER_MULTIPROC_METHOD",
        "spawn",
        _choice("spawn", "forkserver"),
        "How the mp executor starts stage processes: spawn (a fresh interpreter each) or "
        "forkserver (forked from one server process that imported torch and the worker once; "
        "much faster when engines are created often).",
    ),
    EnvVar(
        "VLLM_DP_CPU_BIND",
        "auto",
        _cpu_bind,
        "CPU cores of each data-parallel replica (the replica's engine process, its in-process "
        "worker and the worker processes it starts), so replicas sharing a host do not "
        "oversubscribe it: 'auto' splits this process's cores evenly among the mp replicas, "
        "and gives a Ray replica as many cores as the CPUs its placement holds, disjoint from "
        "the other replicas on the same physical host; 'none' binds nothing; or one core list "
        "per local replica, '|'-separated ('0|1', '0-3|4-7'). Each bound replica runs "
        "torch with one thread per core (unless OMP_NUM_THREADS is set).",
    ),
    EnvVar(
        "VLLM_HOST_IP",
        None,
        _text,
        "The address this process's gloo collectives listen on and advertise to their peers. "
        "Unset: a Ray worker uses its Ray node's IP (never the loopback address a hostname "
        "may resolve to, which a peer on another node cannot reach); other workers use "
        "gloo's default (the address the hostname resolves to).",
    ),
    EnvVar(
        "VLLM_RAY_PER_WORKER_CPUS",
        1.0,
        _positive_float("CPUs"),
        "Ray CPUs each worker actor takes (fractions allowed): a pipeline stage's placement "
        "bundle holds tensor_parallel_size of them, so a stage fits a node with that many.",
    ),
    EnvVar(
        "VLLM_RAY_PLACEMENT_TIMEOUT_S",
        60.0,
        _positive_float("seconds"),
        "How long the engine waits for Ray to place a replica's workers (a placement group "
        "the cluster could hold but whose resources are taken) before it fails naming what "
        "is missing. A placement no node could ever hold fails at once.",
    ),
    EnvVar(
        "VLLM_CPU_KVCACHE_SPACE",
        2.0,
        _positive_float("GiB"),
        "KV cache budget on CPU, in GiB, when kv_cache_memory_bytes is not given.",
    ),
    EnvVar(
        "VLLM_CPU_ONEDNN_CACHE_CAPACITY",
        16,
        _positive_int,
        "Entries of oneDNN's primitive cache and of PyTorch's ideep cache in each engine "
        "process, unless ONEDNN_PRIMITIVE_CACHE_CAPACITY / LRU_CACHE_CAPACITY are set. Both "
        "keep one entry per GEMM shape (each new batch size is a new shape), ~0.5 MiB each, up "
        "to 1024 by default: unbounded, they grow resident memory for thousands of requests.",
    ),
    EnvVar(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
        None,
        _text,
        "oneDNN's own: entries of its primitive cache (default: VLLM_CPU_ONEDNN_CACHE_CAPACITY).",
    ),
    EnvVar(
        "LRU_CACHE_CAPACITY",
        None,
        _text,
        "PyTorch's ideep (oneDNN) op cache size (default: VLLM_CPU_ONEDNN_CACHE_CAPACITY).",
    ),
    EnvVar(
        "VLLM_FP8_DEQUANT",
        "auto",
        _choice("auto", "load", "forward"),
        "How FP8 checkpoint weights run: load (dequantize once at load), forward (keep FP8 in "
        "memory, dequantize per layer: half the weight memory, slower decode) or auto (the FP8 "
        "block GEMM on CUDA where available, else load on CPU and forward on GPUs).",
    ),
    EnvVar(
        "VLLM_SPARSE_MLA_BACKEND",
        None,
        _text,
        "Sparse MLA (DeepSeek-V3.2 DSA) attention implementation by registered name "
        "(TORCH_MLA_SPARSE, TRITON_MLA_SPARSE). Unset: Triton on GPUs when importable, the "
        "torch reference otherwise.",
    ),
    EnvVar(
        "VLLM_ATTENTION_BACKEND",
        None,
        _choice("TRITON_ATTN", "TRITON_MLA", "FLASHINFER", "TORCH_SDPA", upper=True),
        "Attention implementation of standard and dense MLA layers, as vLLM names them: "
        "TRITON_ATTN (Triton paged kernels; MLA layers the Triton MLA kernel, also named "
        "TRITON_MLA), FLASHINFER (standard layers whose shapes it fits, when flashinfer is "
        "installed; MLA layers Triton), TORCH_SDPA (the torch reference; on CPU its C++ paged "
        "kernel). Unset: FlashInfer where installed and fitting, else Triton on GPUs; the "
        "torch reference on CPU. Triton on CPU needs TRITON_INTERPRET=1 (its interpreter).",
    ),
    EnvVar(
        "VLLM_CHAT_TEMPLATE_TIMEOUT_S",
        # Real templates render in milliseconds.
        5.0,
        _positive_float("seconds"),
        "How long a request-supplied chat template (--trust-request-chat-template) may take to "
        "render in its sandbox process before it is killed and the request refused.",
    ),
    EnvVar(
        "VLLM_CPU_KERNELS",
        True,
        _flag,
        "0 runs the torch reference path instead of the C++ CPU kernels (csrc/cpu: paged "
        "attention (decode and prefill), fused RMSNorm + residual, rotary, the small-batch "
        "linear).",
    ),
    EnvVar(
        "VLLM_CPU_LINEAR_ISA",
        "auto",
        _choice("auto", "avx512bf16", "avx512", "avx2", "portable"),
        "Instruction-set path of the CPU small-M linear kernel (decode / verify / draft rows): "
        "auto picks the best this CPU has (cpuid); naming one the CPU lacks is an error. For "
        "tests and benchmarks of each path.",
    ),
    EnvVar(
        "VLLM_CPU_PREFILL_ATTN_ISA",
        "auto",
        _choice("auto", "avx512bf16", "avx512", "avx2", "portable"),
        "Instruction-set path of the CPU prefill attention kernel (prefill and chunked-prefill "
        "requests, read from the paged cache): auto picks the best this CPU has (cpuid; "
        "avx512bf16 runs the avx512 path, bf16 widened to fp32 per key tile); naming one the "
        "CPU lacks is an error. For tests and benchmarks of each path.",
    ),
    EnvVar(
        "VLLM_CPU_PREFILL_GEMM",
        "auto",
        _choice("auto", "torch", "onednn", "fp32", "onednn-fp32"),
        "BLAS route of prefill products on CPU: torch (torch's linear in the model's dtype: "
        "MKL for fp32), onednn (oneDNN's linear), and for bf16 models fp32 / onednn-fp32 "
        "(the same on fp32 copies). auto times the candidates once per process on the first "
        "prefill product (the start-up warm-up's) and keeps the fastest.",
    ),
    EnvVar(
        "VLLM_STEP_COST_BUDGET_S",
        4.0,
        _positive_float("seconds"),
        "Seconds the start-up measurement of step costs (adaptive speculative K) may take: "
        "batch sizes are timed in increasing order while the next one is expected to fit "
        "(the first two always); the cost model extrapolates past the last one timed.",
    ),
    EnvVar(
        "VLLM_CPU_KERNELS_BUILD_DIR",
        None,
        _text,
        "Where the CPU kernels are built and cached (unset: ~/.cache/vllm/cpu_kernels).",
    ),
    EnvVar(
        "VLLM_CACHE_ROOT",
        None,
        _text,
        "Root of the engine's on-disk caches (the model zoo's converted models, the CPU "
        "kernels' builds). Unset: $XDG_CACHE_HOME/vllm, or ~/.cache/vllm.",
    ),
    EnvVar(
        "VLLM_BENCH_CACHE",
        None,
        _text,
        "Where `vllm bench` keeps converted models (unset: vllm-bench under the temp dir).",
    ),
    EnvVar(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        False,
        _flag,
        "1 lets the server load and unload LoRA adapters at run time (/v1/load_lora_adapter, "
        "/v1/unload_lora_adapter; needs --enable-lora).",
    ),
    EnvVar(
        "VLLM_API_KEY",
        None,
        _text,
        "API key the server requires as `Authorization: Bearer KEY` on /v1/* when --api-key "
        "is not given.",
    ),
    EnvVar(
        "VLLM_LOGGING_LEVEL",
        "INFO",
        _choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", upper=True),
        "Level of the `vllm` logger (read once, at import).",
    ),
    EnvVar(
        "VLLM_TEST_FAULT_RAISE",
        None,
        _fault_spec,
        "A test hook (fault injection), never for production: 'RANK:MARKER:N' makes worker "
        "RANK raise a RuntimeError inside its forward at the N-th step that schedules a "
        "request whose id contains MARKER (a client's request_id), as a stage whose model "
        "fails would. Unset: no fault.",
    ),
    # Read here too, though other packages own them, so that every variable the engine reacts
    # to is listed in one place.
    EnvVar(
        "XDG_CACHE_HOME",
        None,
        _text,
        "The XDG base-directory spec's: where user caches live (VLLM_CACHE_ROOT's default).",
    ),
    EnvVar(
        "RAY_ADDRESS",
        None,
        _text,
        "Ray's own: an existing cluster the ray executor (and data_parallel_backend='ray') "
        "joins - host:port of its head, or 'auto' for the one `ray start --head` started on "
        "this machine; unset, the engine starts a local Ray with one CPU per worker.",
    ),
    EnvVar(
        "OMP_NUM_THREADS",
        None,
        _text,
        "OpenMP's own: when unset, each CPU pipeline stage takes an equal share of the host's "
        "cores instead of all of them, except in a step the engine runs alone (nothing else "
        "in flight: one stage computes at a time), which takes them all; set, every stage "
        "keeps that many threads.",
    ),
    EnvVar(
        "TRITON_INTERPRET",
        False,
        _flag,
        "Triton's own: run Triton kernels in its interpreter (on CPU), e.g. to test them.",
    ),
]
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}

if TYPE_CHECKING:  # the names this module provides
    VLLM_CPU_KERNELS: bool
    VLLM_CPU_KERNELS_BUILD_DIR: str | None
    VLLM_CPU_LINEAR_ISA: str
    VLLM_CPU_PREFILL_ATTN_ISA: str
    VLLM_STEP_COST_BUDGET_S: float
    VLLM_CPU_PREFILL_GEMM: str
    VLLM_BENCH_CACHE: str | None
    VLLM_CACHE_ROOT: str | None
    XDG_CACHE_HOME: str | None
    VLLM_PP_STEP_TIMEOUT_S: float
    VLLM_PP_COMM_TIMEOUT_S: float
    VLLM_PP_LAYER_PARTITION: str | None
    VLLM_WORKER_MULTIPROC_METHOD: str
    VLLM_CPU_KVCACHE_SPACE: float
    VLLM_DP_CPU_BIND: str | list[list[int]]
    VLLM_HOST_IP: str | None
    VLLM_RAY_PER_WORKER_CPUS: float
    VLLM_RAY_PLACEMENT_TIMEOUT_S: float
    VLLM_CPU_ONEDNN_CACHE_CAPACITY: int
    ONEDNN_PRIMITIVE_CACHE_CAPACITY: str | None
    LRU_CACHE_CAPACITY: str | None
    VLLM_FP8_DEQUANT: str
    VLLM_SPARSE_MLA_BACKEND: str | None
    VLLM_ATTENTION_BACKEND: str | None
    VLLM_CHAT_TEMPLATE_TIMEOUT_S: float
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: bool
    VLLM_API_KEY: str | None
    VLLM_TEST_FAULT_RAISE: tuple[int, str, int] | None
    VLLM_LOGGING_LEVEL: str
    RAY_ADDRESS: str | None
    OMP_NUM_THREADS: str | None
    TRITON_INTERPRET: bool


def __getattr__(name: str) -> Any:
    var = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(ENV_VARS)


# Settings that describe the process's own node: never carried to another node.
_NODE_LOCAL = frozenset({"VLLM_HOST_IP"})


def vllm_env() -> dict[str, str]:
    """The engine's VLLM_* settings, to apply in every stage process (and Ray node), less the
    node-local ones (VLLM_HOST_IP: each node's own address)."""
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k not in _NODE_LOCAL}


def apply_vllm_env(env: dict[str, str]) -> None:
    """Make this process's VLLM_* settings exactly `env`."""
    # A fork server's children inherit the server's environment, not the engine's current one.
    for k in [
        k for k in os.environ if k.startswith("VLLM_") and k not in env and k not in _NODE_LOCAL
    ]:
        del os.environ[k]
    os.environ.update(env)


def cache_root() -> Path:
    """The engine's cache root: VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm."""
    root = __getattr__("VLLM_CACHE_ROOT")
    if root:
        return Path(root)
    return Path(__getattr__("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"


def bound_onednn_caches() -> None:
    """Cap oneDNN's and ideep's per-shape caches in this process at
    VLLM_CPU_ONEDNN_CACHE_CAPACITY, unless the user set them (both libraries read their
    variable when they first run a primitive)."""
    cap = str(__getattr__("VLLM_CPU_ONEDNN_CACHE_CAPACITY"))
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        if __getattr__(name) is None:
            os.environ[name] = cap
