# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Shared benchmark helpers: model folders built on the fly, a timer, the CPU header, the
throughput drivers' workload (arguments, random prompt ids) and timed greedy chats."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def parse_workload(
    ap: Any, default_model: Callable[[], str], model_help: str, input_len: int
) -> tuple[Any, str, list[list[int]]]:
    """A throughput driver's workload: its arguments (added to argparse parser ap, which holds
    the driver's own), the model (--model, else default_model()) and --num-prompts prompts of
    --input-len random token ids of its vocabulary (seeded). Returns (args, model, prompts)."""
    import torch
    from transformers import AutoConfig

    ap.add_argument("--model", default=None, help=f"checkpoint folder (default: {model_help})")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=input_len)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    model = args.model or default_model()
    vocab = AutoConfig.from_pretrained(model).vocab_size
    g = torch.Generator().manual_seed(0)
    shape = (args.num_prompts, args.input_len)
    return args, model, torch.randint(10, vocab - 1, shape, generator=g).tolist()


def make_chat_llm(
    model: str, dtype: str, spec: dict | None, max_model_len: int, max_num_batched_tokens: int
) -> Any:
    """An LLM for the speculative-decoding chat drivers (a small step budget keeps start-up's
    warm-up, which prefills a full budget, short)."""
    from vllm import LLM

    return LLM(
        model=model,
        dtype=dtype,
        speculative_config=spec,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
    )


def spec_counters(llm: Any) -> tuple[float, float]:
    """(drafts, accepted draft tokens) the engine has counted so far."""
    m = {x.name: x for x in llm.get_metrics()}
    d = m.get("vllm:spec_decode_num_drafts")
    a = m.get("vllm:spec_decode_num_accepted_tokens")
    return (d.value if d else 0.0, a.value if a else 0.0)


def timed_chats(llm: Any, chats: list[list[dict]], out_len: int) -> tuple:
    """Greedy chats one after another (batch 1): (tokens/s, tokens, drafts, accepted draft
    tokens, each chat's output token ids)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=out_len)
    d0, a0 = spec_counters(llm)
    t = time.perf_counter()
    outs = [llm.chat([c], sp, use_tqdm=False)[0] for c in chats]
    dt = time.perf_counter() - t
    d1, a1 = spec_counters(llm)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    toks = sum(len(x) for x in ids)
    return toks / dt, toks, d1 - d0, a1 - a0, ids
