# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""InputProcessor: everything a request goes through before an engine core schedules it, apart
from the core (schedule / execute / update), as upstream vLLM splits them: prompt validation,
tokenisation, multimodal preprocessing (images to placeholder runs and pixels), the request
checks (grammar compiling included), adapters checked, unseeded requests' seeds drawn, and the
Requests of a prompt (one per completion, each with its own params, seed and reasoning gate).
Reads only the tokenizer and fixed configuration, so the prompt half may run off the engine
thread (the server tokenises on a thread)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.exceptions import VLLMTypeError, VLLMValidationError
from vllm.logger import init_logger
from vllm.lora.peft import LoRAChecker
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalInputs
from vllm.multimodal.processing import ImageProcessor
from vllm.reasoning import ReasoningParser, get_reasoning_parser, reasoning_gate
from vllm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from vllm.v1.request import Request
from vllm.v1.structured_output import get_backend

logger = init_logger(__name__)

PromptType = str | dict[str, Any] | list[int]

# Text longer than max_model_len tokens of the tokenizer's longest vocabulary entry cannot fit;
# the margin covers normalisers that shrink text before it is split into tokens.
_PROMPT_BYTES_MARGIN = 2


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


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


class InputProcessor:
    """Prompt to Requests. fits(num_prompt_tokens) raises for a prompt the engine's KV cache
    can never hold (the engine's own check; None: none)."""

    def __init__(self, vllm_config: VllmConfig, fits: Callable[[int], None] | None = None) -> None:
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        self.model_config = mc
        self._fits = fits
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
        # Adapters are checked (their PEFT folder read once per id) before any worker sees them.
        self.lora_checker = LoRAChecker(vllm_config.lora_config, mc.hf_config)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.generation_config = mc.try_get_generation_config()
        self.priority_policy = vllm_config.scheduler_config.policy == "priority"
        self._rng = random.Random(mc.seed)
        self.max_prompt_bytes = prompt_byte_limit(self.tokenizer, mc.max_model_len)

    def draw_seeds(self, n: int) -> list[int]:
        """Seeds of an unseeded request's n completions, from the engine's seeded generator
        (in request order: a data-parallel front end draws them as one engine would)."""
        return [self._rng.getrandbits(62) for _ in range(n)]

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
        """Validate a prompt: (text, token ids, images); errors name what is wrong. A dict
        prompt's multi_modal_data ({"image": image or list}) expands each <|image_pad|> to
        the image's tokens."""
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
        if self._fits is not None:
            self._fits(len(ids))
        return text, ids, mm

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Refuse, naming the problem, an adapter the engine cannot run (reads its folder
        once per adapter id; thread-safe like process_prompt_mm)."""
        if lora_request is not None:
            self.lora_checker.check(lora_request)

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

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """A dict prompt's optional cache_salt: only requests with the same salt share cached
        prefix blocks (what keeps tenants from probing each other's prompts)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise TypeError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        cache_salt: str | None = None,
        priority: int = 0,
        mm_inputs: MultiModalInputs | None = None,
        seeds: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[Request]:
        """The Requests of a checked prompt: one per completion (params.n), each with its own
        params (n = 1, the tokenizer's and generation config's defaults, the reasoning gate of
        a grammar), and its seed (the request's, derived per completion; else seeds, drawn by
        a data-parallel front end; else drawn here)."""
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
            elif seeds is not None:
                seed = seeds[i]
            else:
                (seed,) = self.draw_seeds(1)
            cid = request_id if params.n == 1 else f"{i}_{request_id}"
            requests.append(
                Request(
                    cid,
                    ids,
                    child_params,
                    arrival_time,
                    seed,
                    cache_salt,
                    priority,
                    mm_inputs,
                    self.lora_checker.checked(lora_request),
                )
            )
        return requests
