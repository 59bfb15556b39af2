# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Shared benchmark helpers: model folders built on the fly and a timer."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CACHE = Path(os.environ.get("VLLM_BENCH_CACHE", Path(tempfile.gettempdir()) / "vllm-bench"))


def tiny_llama() -> str:
    from vllm.testing.checkpoints import make_llama

    out = CACHE / "tiny-llama"
    if not (out / "config.json").exists():
        make_llama(
            str(out),
            num_hidden_layers=4,
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    return str(out)


def smollm2() -> str:
    from vllm.model_zoo import smollm2_path

    return smollm2_path(CACHE / "smollm2-135m")


def resolve_model(name: str) -> str:
    return {"tiny": tiny_llama, "smollm2": smollm2}.get(name, lambda: name)()


@contextmanager
def timer():
    t = {"s": 0.0}
    start = time.perf_counter()
    try:
        yield t
    finally:
        t["s"] = time.perf_counter() - start


def cpu_flags() -> str:
    """The CPU model and which of the vector ISAs that matter here it has (from /proc/cpuinfo:
    measured, not assumed), for the header of every benchmark result."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "?"
    )
    flags = set(
        next(
            (ln.split(":", 1)[1] for ln in info.splitlines() if ln.startswith("flags")), ""
        ).split()
    )
    have = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}; {' '.join(have)}"
