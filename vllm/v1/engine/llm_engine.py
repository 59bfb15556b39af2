# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""LLMEngine: add requests, step (schedule -> execute -> update -> detokenise), abort."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMTypeError, VLLMValidationError
from vllm.logger import init_logger
from vllm.multimodal.inputs import MultiModalInputs
from vllm.multimodal.processing import ImageProcessor
from vllm.outputs import RequestOutput
from vllm.reasoning import ReasoningParser, get_reasoning_parser, reasoning_gate
from vllm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.output_processor import ChildState, OutputProcessor, RequestState
from vllm.v1.engine.warmup import measure_step_costs, warm_up
from vllm.v1.executor.abstract import Executor
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.reader import Metric, get_metrics_snapshot
from vllm.v1.metrics.stats import IterationStats, spec_proposer_names
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import get_backend

logger = init_logger(__name__)

PromptType = str | dict[str, Any] | list[int]

# Text longer than max_model_len tokens of the tokenizer's longest vocabulary entry cannot fit;
# the margin covers normalisers that shrink text before it is split into tokens.
_PROMPT_BYTES_MARGIN = 2


def check_kv_cache_fits(vllm_config: VllmConfig, num_blocks: int) -> None:
    """Refuse a KV cache that cannot hold one request of max_model_len tokens (plus the
    drafts' lookahead), as vLLM does at start-up: such a request would wait for blocks that
    can never exist."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    assert mc.max_model_len is not None
    lookahead = vllm_config.num_speculative_tokens
    need = -(-(mc.max_model_len + lookahead) // cc.block_size)
    if need > num_blocks:
        extra = f" + {lookahead} draft tokens" if lookahead else ""
        raise ValueError(
            f"max_model_len ({mc.max_model_len} tokens{extra}) needs {need} KV cache blocks of "
            f"{cc.block_size} tokens for one request, but the KV cache holds only {num_blocks} "
            f"blocks ({num_blocks * cc.block_size} tokens). Lower max_model_len "
            "(--max-model-len) to at most "
            f"{max(num_blocks * cc.block_size - lookahead, 0)}, or give the KV cache more "
            "memory (--kv-cache-memory-bytes, --gpu-memory-utilization, "
            "num_gpu_blocks_override)."
        )


def prompt_byte_limit(tokenizer, max_model_len: int) -> int:
    """Most UTF-8 bytes a prompt may have: anything longer has more than max_model_len tokens.

    A vocabulary entry's own UTF-8 spelling is never shorter than the text it stands for
    (byte-level BPE spells each byte as one or two-byte characters, SentencePiece a space as a
    3-byte '\u2581'), so rejecting by this bound never refuses a prompt that would fit."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view: assume 64 bytes
        vocab = {}
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=64)
    return max_model_len * max(longest, 4) * _PROMPT_BYTES_MARGIN


def check_params(params: SamplingParams | None) -> SamplingParams:
    """The request's SamplingParams (default if None), re-verified: fields may have been set
    after construction, and nothing out of range may reach a worker."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
    params.verify()
    return params


def child_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of an n > 1 request, wrapped into the signed 64-bit range
    (seed = 2**63 - 1 with n = 2 must not overflow the workers' int64 seed slots)."""
    return (seed + index + 2**63) % 2**64 - 2**63


def num_state_slots(vllm_config: VllmConfig) -> int:
    """Hybrid models (linear-attention layers) keep one state slot per running request."""
    return vllm_config.scheduler_config.max_num_seqs if vllm_config.model_config.is_hybrid else 0


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        self.model_config = mc
        # Seconds of each start-up phase, in order (logged once the engine is ready).
        self.startup_phases: dict[str, float] = {}
        t_phase = time.perf_counter()
        # ModelConfig.__post_init__ resolves both from the checkpoint.
        assert mc.tokenizer is not None and mc.max_model_len is not None
        self.tokenizer = load_tokenizer(mc.tokenizer, mc.trust_remote_code)
        # --reasoning-parser: a grammar waits for the end of the reasoning (unless
        # enable_in_reasoning); checked before any worker starts.
        soc = vllm_config.structured_outputs_config
        self.reasoning_parser: ReasoningParser | None = None
        if soc.reasoning_parser:
            self.reasoning_parser = get_reasoning_parser(soc.reasoning_parser)(self.tokenizer)
        # Multimodal checkpoints: their image processor (from the model folder).
        self._mm_processor: ImageProcessor | None = None
        self._mm_unavailable = f"the model {mc.model!r} takes no multimodal input"
        if mc.is_multimodal:
            try:
                self._mm_processor = ImageProcessor(
                    mc.model, mc.hf_config, mc.image_limit(), self.tokenizer
                )
            except ValueError as e:
                # Text prompts still run; a prompt with images is refused with this reason.
                logger.warning("%s; prompts with images will be refused", e)
                self._mm_unavailable = str(e)
        t_phase = self._phase("tokenizer", t_phase)
        self.executor = Executor.get_class(vllm_config)(vllm_config)
        t_phase = self._phase("load", t_phase)  # workers started, weights loaded
        try:
            num_blocks = self.executor.determine_num_blocks()
            override = vllm_config.cache_config.num_gpu_blocks_override
            if override is not None:
                logger.info(
                    "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d",
                    num_blocks,
                    override,
                )
                num_blocks = override
            check_kv_cache_fits(vllm_config, num_blocks)
            self.executor.initialize_kv_cache(num_blocks)
            t_phase = self._phase("pools", t_phase)
            warm_up(vllm_config, self.executor, num_blocks, num_state_slots(vllm_config))
            t_phase = self._phase("warm-up", t_phase)
            step_costs = measure_step_costs(
                vllm_config, self.executor, num_blocks, num_state_slots(vllm_config)
            )
            if step_costs is not None:
                t_phase = self._phase("step costs", t_phase)
            self.executor.collective_rpc("end_warm_up")
        except BaseException:
            self.executor.shutdown()
            raise
        bs = vllm_config.cache_config.block_size
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max concurrency at max_model_len=%d: "
            "%.1f",
            num_blocks,
            bs,
            num_blocks * bs,
            mc.max_model_len,
            num_blocks * bs / mc.max_model_len,
        )
        self.scheduler = Scheduler(
            vllm_config, num_blocks, num_state_slots(vllm_config), step_costs=step_costs
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.generation_config = mc.try_get_generation_config()
        self.priority_policy = vllm_config.scheduler_config.policy == "priority"
        self._rng = random.Random(mc.seed)
        self.max_prompt_bytes = prompt_byte_limit(self.tokenizer, mc.max_model_len)
        k = vllm_config.num_speculative_tokens
        self.prom = PrometheusStatLogger(
            mc.served_model_names[0],
            k,
            max_model_len=mc.max_model_len,
            spec_proposers=spec_proposer_names(vllm_config.speculative_config),
            cache_config_info={
                f.name: str(getattr(vllm_config.cache_config, f.name))
                for f in dataclasses.fields(vllm_config.cache_config)
            },
        )
        self.log_stats = not vllm_config.disable_log_stats
        self.stat_logger = LoggingStatLogger(k) if self.log_stats else None
        self._req_counter = 0
        self._batch_queue: deque = deque()  # steps in flight (pipeline parallelism)
        self._phase("engine", t_phase)
        logger.info(
            "Start-up: engine ready in %.2f s (%s)",
            sum(self.startup_phases.values()),
            ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_phases.items()),
        )

    def _phase(self, name: str, since: float) -> float:
        """Record the phase that began at `since` as ended now; return now."""
        now = time.perf_counter()
        self.startup_phases[name] = now - since
        return now

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    # ---- inputs -------------------------------------------------------------------------
    def check_prompt_text(self, text: str) -> None:
        """Refuse text that cannot be tokenised or cannot fit, before spending time on it."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the prompt is not valid Unicode text: {e.reason} at position {e.start}"
            ) from None
        if size > self.max_prompt_bytes:
            raise ValueError(
                f"the prompt has {size} bytes; at most {self.max_prompt_bytes} bytes are "
                f"accepted (max_model_len={self.model_config.max_model_len} tokens)"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenise checked text (thread-safe: the server calls it from a tokenizer thread)."""
        self.check_prompt_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text, token ids); errors name what is wrong.

        Reads only the tokenizer and fixed limits, so it may run off the engine thread."""
        text, ids, _ = self.process_prompt_mm(prompt)
        return text, ids

    @property
    def image_placeholder(self) -> str | None:
        """The prompt text of one image (a chat message's image part), or None when the model
        takes no images."""
        return self._mm_processor.placeholder if self._mm_processor is not None else None

    def _image_processor(self) -> ImageProcessor:
        if self._mm_processor is None:
            raise ValueError(f"multi_modal_data: {self._mm_unavailable}")
        return self._mm_processor

    def process_prompt_mm(
        self, prompt: PromptType
    ) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """process_prompt plus the prompt's images: a dict prompt's multi_modal_data
        ({"image": image or list}) expands each <|image_pad|> to the image's tokens."""
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text = prompt["prompt"]
                if not isinstance(text, str):
                    raise TypeError(f"prompt must be a string, got {type(text).__name__}")
                ids = self.encode(text)
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise TypeError(f"unsupported prompt type {type(prompt).__name__}")
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise TypeError("prompt_token_ids must be a list of integers")
        ids = list(ids)
        mm: MultiModalInputs | None = None
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is not None:
            ids, mm = self._image_processor().process(ids, mm_data)
            if not mm.features:
                mm = None
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise VLLMValidationError(
                f"token id {bad[0]} is out of vocabulary (vocab_size={vocab})", parameter="prompt"
            )
        max_len = self.model_config.max_model_len
        assert max_len is not None
        if len(ids) >= max_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {max_len} (it must leave room for at least one output token)"
            )
        if not self.scheduler.kv_cache_manager.can_ever_fit(len(ids) + 1):
            raise ValueError(
                f"the prompt of {len(ids)} tokens can never fit in the KV cache "
                f"({self.scheduler.kv_cache_manager.num_blocks} blocks of "
                f"{self.scheduler.block_size} tokens)"
            )
        return text, ids, mm

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        params = check_params(params)
        self.check_request(params, priority)
        text, ids, cache_salt, mm = self.preprocess(prompt)
        self.add_processed_request(
            request_id, text, ids, params, arrival_time, cache_salt, priority, mm
        )

    def check_request(self, params: SamplingParams, priority: int = 0) -> None:
        """What the engine's configuration refuses in a request (vLLM's checks and wording):
        token ids outside the vocabulary, more logprobs than max_logprobs, a priority without
        the priority scheduling policy."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids or () if t >= vocab]
        if bad:
            raise VLLMValidationError(
                f"stop_token_ids contains token id {bad[0]}, outside the vocabulary "
                f"(vocab_size={vocab})",
                parameter="stop_token_ids",
                value=bad[0],
            )
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise VLLMValidationError(
                    f"{name} contains out-of-vocab token id {bad[0]} (vocab_size={vocab})",
                    parameter=name,
                    value=bad[0],
                )
        if params.bad_words:
            params.update_bad_words(lambda w: self.encode(w, add_special_tokens=False))
            bad = [t for ids in params.bad_words_token_ids for t in ids if t >= vocab]
            if bad:
                raise VLLMValidationError(
                    f"bad_words tokenize to token ids outside the vocabulary (vocab_size="
                    f"{vocab}): {bad}",
                    parameter="bad_words",
                )
        if params.structured_outputs is not None:
            so = params.structured_outputs
            # The engine-wide settings apply to every request (a request may add its own); the
            # params travel to the last stage, which compiles the same grammar for its matcher.
            soc = self.vllm_config.structured_outputs_config
            so.disable_any_whitespace |= soc.disable_any_whitespace
            so.disable_additional_properties |= soc.disable_additional_properties
            # A grammar that does not compile is refused here, naming the problem.
            assert self.model_config.tokenizer is not None
            get_backend(self.model_config.tokenizer, vocab, self.tokenizer).compile(
                params.structured_outputs
            )
        limit = self.model_config.max_logprobs
        limit = vocab if limit == -1 else limit
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            n = getattr(params, name)
            n = vocab if n == -1 else n
            if n is not None and n > limit:
                raise VLLMValidationError(
                    f"Requested {kind} logprobs of {n}, which is greater than max allowed: "
                    f"{limit} ({name}; the server's --max-logprobs)",
                    parameter=name,
                    value=n,
                )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise VLLMTypeError(
                f"priority must be an integer, got {priority!r}", parameter="priority"
            )
        if not INT64_MIN <= priority <= INT64_MAX:
            raise VLLMValidationError(
                f"priority must be a 64-bit integer, got {priority}", parameter="priority"
            )
        if priority != 0 and not self.priority_policy:
            raise VLLMValidationError(
                f"Got priority {priority} but Priority scheduling is not enabled "
                "(--scheduling-policy priority)",
                parameter="priority",
                value=priority,
            )

    def preprocess(
        self, prompt: PromptType
    ) -> tuple[str | None, list[int], str | None, MultiModalInputs | None]:
        """(text, checked token ids, cache_salt, images) of a prompt; thread-safe like
        process_prompt."""
        cache_salt = self._cache_salt(prompt)
        text, ids, mm = self.process_prompt_mm(prompt)
        return text, ids, cache_salt, mm

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
    ) -> None:
        """Add a request whose prompt already went through preprocess (the server does that
        on a tokenizer thread, so a long prompt never holds up the engine thread)."""
        params = check_params(params)
        self.check_request(params, priority)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids
        so = params.structured_outputs
        gate = None  # set on the children: the caller's params may be shared by prompts
        if (
            so is not None
            and so._reasoning_gate is None
            and self.reasoning_parser is not None
            and not self.vllm_config.structured_outputs_config.enable_in_reasoning
        ):
            gate = reasoning_gate(self.reasoning_parser, ids)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        children: dict[str, ChildState] = {}
        requests = []
        for i in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if gate is not None:
                assert child_params.structured_outputs is not None
                child_params.structured_outputs._reasoning_gate = gate
            child_params.update_from_tokenizer(self.eos_token_id)
            child_params.update_from_generation_config(self.generation_config, self.eos_token_id)
            if params.seed is not None:
                seed = child_seed(params.seed, i)
            else:
                seed = self._rng.getrandbits(62)
            cid = request_id if params.n == 1 else f"{i}_{request_id}"
            children[cid] = ChildState(i, child_params)
            requests.append(
                Request(cid, ids, child_params, arrival_time, seed, cache_salt, priority, mm_inputs)
            )
        self.output_processor.add(
            RequestState(request_id, text, ids, params, children, arrival_time)
        )
        for r in requests:
            self.scheduler.add_request(r)

    @staticmethod
    def _cache_salt(prompt: PromptType) -> str | None:
        """A dict prompt's optional cache_salt: only requests with the same salt share cached
        prefix blocks (what keeps tenants from probing each other's prompts)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise TypeError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changes) while requests hold KV blocks."""
        return self.scheduler.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = time.time()
        stats = IterationStats()
        for rid in request_ids:
            st = self.output_processor.requests.get(rid)
            if st is None:
                continue
            self.scheduler.finish_requests(list(st.children), RequestStatus.FINISHED_ABORTED)
            for child in st.children.values():
                if child.finish_reason is None:
                    self.output_processor.record_finished(st, child, "abort", now, stats)
                    child.finish_reason = "abort"
            self.output_processor.remove(rid)
        self.prom.record_iteration(stats)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def next_request_id(self) -> str:
        self._req_counter += 1
        return str(self._req_counter - 1)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0 and not so.finished_req_ids:
            return []
        self._mark_scheduled(so)
        return self._process_output(so, self.executor.execute_model(so))

    def _mark_scheduled(self, so) -> None:
        if so.scheduled_new_reqs:
            ids = [r.req_id for r in so.scheduled_new_reqs]
            self.output_processor.mark_scheduled(ids, time.time())

    def _step_pipelined(self) -> list[RequestOutput]:
        """Keep up to max_concurrent_batches steps in flight so pipeline stages overlap: start
        a new batch while there is room and work, otherwise finish the oldest one."""
        limit = self.executor.max_concurrent_batches
        queue = self._batch_queue
        if len(queue) < limit:
            sched = self.scheduler
            # Split the requests across the batches in flight, else one batch takes them all.
            share = -(-min(sched.get_num_unfinished_requests(), sched.max_num_seqs) // limit)
            so = sched.schedule(max_num_reqs=max(1, share))
            if so.total_num_scheduled_tokens or so.finished_req_ids:
                self._mark_scheduled(so)
                self.executor.execute_model_async(so)
                queue.append(so)
                if so.total_num_scheduled_tokens and len(queue) < limit:
                    return []
        if not queue:
            return []
        so = queue.popleft()
        return self._process_output(so, self.executor.get_output())

    def _process_output(self, so, runner_out) -> list[RequestOutput]:
        result = self.scheduler.update_from_output(so, runner_out)
        now = time.time()
        iteration = IterationStats()
        outputs, to_abort = self.output_processor.process(result.outputs, now, iteration)
        if to_abort:
            self.scheduler.finish_requests(to_abort, RequestStatus.FINISHED_STOPPED)
        self._record_stats(so, result, iteration)
        for ro in outputs:
            if ro.finished:
                self.output_processor.remove(ro.request_id)
        return outputs

    def _record_stats(self, so, result, iteration: IterationStats) -> None:
        num_prompt = so.num_prompt_tokens
        num_gen = sum(len(out.new_token_ids) for out in result.outputs.values())
        self.prom.record(result.stats, num_prompt, num_gen, iteration)
        if self.stat_logger is not None:
            self.stat_logger.record(result.stats, num_prompt, num_gen)

    def get_metrics(self) -> list[Metric]:
        return get_metrics_snapshot(self.prom.registry)

    def shutdown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
            # Dropped so a shut-down engine cannot step again; only shutdown() sees None.
            self.executor = None  # type: ignore[assignment]

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
