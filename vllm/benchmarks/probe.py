# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""What the offline benchmarks measure an engine with: the per-step probe (step time, time
inside the model forward, prefill vs decode) and the HF transformers baseline they compare
against (same checkpoint, dtype and prompts)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# ----------------------------------------------------------------------------- step probe


@dataclass
class StepRecord:
    wall_s: float
    forward_s: float  # inside the model forward and the output head
    num_tokens: int
    num_reqs: int
    is_decode: bool  # no prompt token scheduled
    end_s: float  # perf_counter() when the step returned
    cpu_s: float = 0.0  # process CPU time of the step (at one thread: time actually on a core)


@dataclass
class ProbeResult:
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.steps)

    def host_share(self, decode_only: bool = False) -> float | None:
        """Share of step time spent outside the model forward (None when not measurable)."""
        steps = [s for s in self.steps if s.is_decode or not decode_only]
        wall = sum(s.wall_s for s in steps)
        if not steps or wall == 0 or all(s.forward_s == 0 for s in steps):
            return None
        return 1.0 - sum(s.forward_s for s in steps) / wall

    def decode_step_times(self) -> list[float]:
        return [s.wall_s for s in self.steps if s.is_decode]

    def decode_step_cpu_times(self) -> list[float]:
        return [s.cpu_s for s in self.steps if s.is_decode]


class EngineProbe:
    """Times each engine step of an LLM and the model forward inside it, by wrapping bound
    methods of this one engine instance (nothing global; removed on exit). The forward is only
    visible when the model lives in this process (P = 1)."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        runner = getattr(getattr(self.engine.executor, "worker", None), "model_runner", None)
        self.runner = runner
        self.model = getattr(runner, "model", None)
        self.device_type = getattr(getattr(runner, "device", None), "type", "cpu")

    @contextmanager
    def record(self) -> Iterator[ProbeResult]:
        result = ProbeResult()
        eng, model = self.engine, self.model
        fwd = {"s": 0.0}
        last: dict[str, Any] = {}
        sync = torch.cuda.synchronize if self.device_type == "cuda" else (lambda: None)
        patched: list[tuple[Any, str]] = []

        def timed(fn: Callable) -> Callable:
            def wrapper(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                sync()
                fwd["s"] += time.perf_counter() - t0
                return out

            return wrapper

        orig_schedule = eng.scheduler.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            so = orig_schedule(*a, **k)
            last["so"] = so
            return so

        orig_step = eng.step

        def step() -> Any:
            fwd["s"] = 0.0
            last.pop("so", None)
            t0, c0 = time.perf_counter(), time.process_time()
            out = orig_step()
            end = time.perf_counter()
            cpu = time.process_time() - c0
            wall = end - t0
            so = last.get("so")
            if so is not None and so.total_num_scheduled_tokens:
                result.steps.append(
                    StepRecord(
                        wall,
                        fwd["s"],
                        so.total_num_scheduled_tokens,
                        len(so.num_scheduled_tokens),
                        so.num_prompt_tokens == 0,
                        end,
                        cpu,
                    )
                )
            return out

        eng.scheduler.schedule, eng.step = schedule, step
        patched += [(eng.scheduler, "schedule"), (eng, "step")]
        if model is not None:
            model.forward = timed(model.forward)
            model.compute_logits = timed(model.compute_logits)
            patched += [(model, "forward"), (model, "compute_logits")]
        try:
            yield result
        finally:
            for obj, name in patched:
                obj.__dict__.pop(name, None)


# ------------------------------------------------------------------------------ HF baseline


class HFBaseline:
    """HF transformers generate on the same checkpoint, dtype and prompts: greedy, no EOS stop
    (as ignore_eos on our side), equal-length prompts batched without padding."""

    def __init__(self, model: str, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        t0 = time.perf_counter()
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # e.g. the MTP layers it does not know: expected
        try:
            # transformers types the wrapped .to() as taking the model itself.
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)  # type: ignore[arg-type]
        finally:
            hf_logging.set_verbosity(level)
        self.model.eval()
        self.load_s = time.perf_counter() - t0
        self.device = device
        gc = copy.deepcopy(self.model.generation_config)
        gc.do_sample = False
        gc.eos_token_id = None  # run every row to max_new_tokens, as ignore_eos does
        gc.temperature = gc.top_p = gc.top_k = None
        gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0
        self.generation_config = gc

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], output_len: int, batch_size: int
    ) -> list[list[int]]:
        gc = copy.copy(self.generation_config)
        gc.max_new_tokens = output_len
        outs: list[list[int]] = []
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size], device=self.device)
            gen = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=gc
            )
            outs += gen[:, ids.shape[1] :].tolist()
        return outs


def compare_outputs(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict:
    """How many greedy outputs are identical, and where the first mismatch starts."""
    same = sum(list(a) == list(b) for a, b in zip(ours, ref))
    first = None
    for i, (a, b) in enumerate(zip(ours, ref)):
        if list(a) != list(b):
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = {"prompt": i, "token": pos}
            break
    return {"identical": same, "total": len(ref), "first_mismatch": first}
