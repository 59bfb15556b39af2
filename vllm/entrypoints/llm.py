# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""The offline API: LLM(...).generate / .chat, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from vllm.beam_search import BeamSearch, BeamSearchOutput
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest, per_prompt_lora
from vllm.multimodal.chat import resolve_content_format, split_images, template_text
from vllm.outputs import RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams
from vllm.v1.engine.engine_factory import create_engine
from vllm.v1.engine.input_processor import PromptType
from vllm.v1.metrics.reader import Metric


class LLM:
    """An offline engine: `LLM(model=PATH, ...)`; unknown arguments raise TypeError."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model=model or "", **kwargs)
        self.engine_args = args
        # One in-process engine, or a front end over data-parallel replicas.
        self.llm_engine = create_engine(args.create_engine_config())

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. `priority` (one per prompt, lower first) needs the engine's
        scheduling_policy='priority'. `lora_request`: one adapter for every prompt, or one
        (or None: the base model) per prompt (needs enable_lora)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if isinstance(sampling_params, (str, bytes)) or not all(
                isinstance(p, SamplingParams) for p in params
            ):
                raise TypeError(
                    "sampling_params must be a SamplingParams or a list of them, got "
                    f"{type(sampling_params).__name__}"
                )
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        loras = per_prompt_lora(lora_request, len(prompts))
        return self._run(prompts, params, use_tqdm, priority, loras)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults the model's generation_config.json sets."""
        defaults = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams(**{k: v for k, v in defaults.items() if hasattr(SamplingParams, k)})

    def _run(
        self,
        prompts: list,
        params: list[SamplingParams],
        use_tqdm: bool,
        priority: list[int] | None = None,
        loras: list[LoRARequest | None] | None = None,
    ):
        engine = self.llm_engine
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = engine.next_request_id()
                engine.add_request(
                    rid,
                    p,
                    sp,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i] if loras else None,
                )
                ids.append(rid)
        except BaseException:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return results

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt (vLLM's beam search: each step
        extends every live beam by its top 2 * beam_width tokens and keeps the beam_width best
        by cum_logprob / length ** length_penalty). A sequence's `tokens` and `text` include
        the prompt, as vLLM's do. concurrency_limit: at most that many prompts are searched
        at a time (None: all at once); the results do not depend on it."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (
            isinstance(concurrency_limit, bool)
            or not isinstance(concurrency_limit, int)
            or concurrency_limit < 1
        ):
            raise ValueError(
                f"concurrency_limit must be None or a positive integer, got {concurrency_limit!r}"
            )
        engine = self.llm_engine
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if any(isinstance(p, dict) and p.get("multi_modal_data") for p in prompts):
            raise ValueError("multi_modal_data: beam search takes text prompts only")
        ids = [engine.process_prompt(p)[1] for p in prompts]
        limit = engine.model_config.max_model_len
        assert limit is not None  # resolved by ModelConfig
        if max(len(t) for t in ids) + params.max_tokens >= limit:
            raise VLLMValidationError(
                f"the longest prompt ({max(len(t) for t in ids)} tokens) plus max_tokens="
                f"{params.max_tokens} exceed max_model_len={limit}",
                parameter="max_tokens",
            )
        loras = per_prompt_lora(lora_request, len(ids))
        chunk = concurrency_limit or len(ids)
        results = []
        for start in range(0, len(ids), chunk):
            search = BeamSearch(
                ids[start : start + chunk], params, self.get_tokenizer().eos_token_id
            )
            step = search.step_params()
            while not search.done:
                outs = self.generate(
                    [{"prompt_token_ids": t} for t in search.pending()],
                    step,
                    use_tqdm=False,
                    lora_request=loras and [loras[start + i] for i in search.pending_prompts()],
                )
                search.advance(
                    [o.outputs[0].logprobs[0] if o.outputs[0].logprobs else {} for o in outs]
                )
            results += search.outputs()
        tok = self.get_tokenizer()
        for r in results:
            for beam in r.sequences:
                beam.text = tok.decode(beam.tokens)
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (chat_template, else the
        tokenizer's) and generate. Image parts become the model's image tokens: in the message
        text ("string" templates) or placed by the template itself ("openai" templates, which
        loop over content parts); "auto" reads which from the template."""
        # One conversation (a list of messages) or a list of them; the first item tells which.
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = cast(list[list[dict[str, Any]]], list(messages))
        tok = self.get_tokenizer()
        engine = self.llm_engine
        content_format = resolve_content_format(
            chat_template_content_format, chat_template or template_text(tok)
        )
        prompts = []
        for conv in conversations:
            # Image parts (image_url data URLs, image_pil) -> image tokens + multi_modal_data.
            conv, images = split_images(
                list(conv),
                engine.image_placeholder,
                engine.model_config.allowed_media_domains,
                content_format,
            )
            text = tok.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            # The template already holds the special tokens; don't add a BOS twice.
            ids = tok.encode(text, add_special_tokens=False)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (e.g. after the weights changed). Returns False, changing
        nothing, while requests still hold KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
