# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""EngineInputs: the interface an engine front offers to LLM, AsyncLLM and the server (the
in-process LLMEngine and the data-parallel DPEngine implement it). Its input side is an
InputProcessor (input_processor.py) it holds and hands calls to; the front adds the request to
its core (add_processed_request) and runs the steps."""

from __future__ import annotations

import time
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalInputs
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor, PromptType, check_params
from vllm.v1.metrics.reader import Metric

logger = init_logger(__name__)


class EngineInputs:
    """An engine front: its InputProcessor (`inputs`) and what the front must implement."""

    def _init_inputs(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        # Seconds of each start-up phase, in order (logged once the engine is ready).
        self.startup_phases: dict[str, float] = {}
        t_phase = time.perf_counter()
        self.inputs = InputProcessor(vllm_config, self._check_fits)
        self._t_phase = self._phase("tokenizer", t_phase)
        self._req_counter = 0

    def _phase(self, name: str, since: float) -> float:
        """Record the phase that began at `since` as ended now; return now."""
        now = time.perf_counter()
        self.startup_phases[name] = now - since
        return now

    def _log_ready(self, t_phase: float) -> None:
        self._phase("engine", t_phase)
        logger.info(
            "Start-up: engine ready in %.2f s (%s)",
            sum(self.startup_phases.values()),
            ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_phases.items()),
        )

    def _check_fits(self, num_prompt_tokens: int) -> None:
        """Refuse a prompt whose KV cache needs exceed the whole cache."""
        raise NotImplementedError

    def add_processed_request(
        self,
        request_id: str,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        mm_inputs: MultiModalInputs | None = None,
        seeds: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        raise NotImplementedError

    # What AsyncLLM and LLM drive (LLMEngine and the data-parallel DPEngine implement it).
    raise_failures = True
    """False: requests that fail alone (a data-parallel replica died) are handed out by
    pop_failures() instead of raised by step()."""

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError

    def get_num_unfinished_requests(self) -> int:
        raise NotImplementedError

    def abort_request(self, request_ids: str | list[str]) -> None:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    def get_metrics(self) -> list[Metric]:
        raise NotImplementedError

    def check_health(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def registry(self) -> Any:
        """The prometheus_client registry the engine's metrics live in."""
        raise NotImplementedError

    def pop_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that failed on their own since the last call (none for one engine)."""
        return []

    def wakeup(self) -> None:
        """Make a step() that waits for work return early (nothing to do for one engine)."""

    # ---- inputs (the InputProcessor's) ------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    @property
    def max_prompt_bytes(self) -> int:
        return self.inputs.max_prompt_bytes

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a completion (unless ignore_eos); set here, it applies to the
        requests made from then on."""
        return self.inputs.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, token_id: int | None) -> None:
        self.inputs.eos_token_id = token_id

    def draw_seeds(self, n: int) -> list[int]:
        return self.inputs.draw_seeds(n)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode(text, add_special_tokens)

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text, token ids); errors name what is wrong.

        Reads only the tokenizer and fixed limits, so it may run off the engine thread."""
        text, ids, _ = self.process_prompt_mm(prompt)
        return text, ids

    def process_prompt_mm(
        self, prompt: PromptType
    ) -> tuple[str | None, list[int], MultiModalInputs | None]:
        return self.inputs.process_prompt_mm(prompt)

    def preprocess(
        self, prompt: PromptType
    ) -> tuple[str | None, list[int], str | None, MultiModalInputs | None]:
        """(text, checked token ids, cache_salt, images) of a prompt; thread-safe like
        process_prompt."""
        cache_salt = InputProcessor.cache_salt(prompt)
        text, ids, mm = self.process_prompt_mm(prompt)
        return text, ids, cache_salt, mm

    @property
    def image_placeholder(self) -> str | None:
        return self.inputs.image_placeholder

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        self.inputs.check_lora(lora_request)

    def check_request(self, params: SamplingParams, priority: int = 0) -> None:
        self.inputs.check_request(params, priority)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = check_params(params)
        self.check_request(params, priority)
        self.check_lora(lora_request)
        text, ids, cache_salt, mm = self.preprocess(prompt)
        self.add_processed_request(
            request_id,
            text,
            ids,
            params,
            arrival_time,
            cache_salt,
            priority,
            mm,
            lora_request=lora_request,
        )

    def next_request_id(self) -> str:
        self._req_counter += 1
        return str(self._req_counter - 1)
