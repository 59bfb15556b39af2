# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""`use_beam_search` requests: the beams of vllm.beam_search run on the async engine (every
live beam one engine request per step), answered as n = beam_width choices, best first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vllm.beam_search import BeamSearch, BeamSearchSequence
from vllm.entrypoints.openai.streams import final_outputs
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream

if TYPE_CHECKING:
    from vllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.protocol import CompletionRequest


class BeamServing(Protocol):
    """What the beam search needs of the server that drives it (the serving base, which
    imports this module)."""

    llm: AsyncLLM

    @property
    def tokenizer(self) -> Any: ...

    async def _add_all(
        self, prompts: list[Any], params: SamplingParams, base_id: str, req: Any
    ) -> list[RequestStream]: ...


def beam_params(
    req: CompletionRequest | ChatCompletionRequest,
    params: SamplingParams,
    longest_prompt: int,
    max_model_len: int,
) -> BeamSearchParams:
    """The request's beam search: n beams, as vLLM reads the fields (temperature defaults to
    1.0, which only adds the step's sampled token to the candidates)."""
    if req.stream:
        raise VLLMValidationError(
            "use_beam_search cannot be streamed (stream must be false)", parameter="use_beam_search"
        )
    max_tokens = params.max_tokens
    if max_tokens is None:  # chat without a limit: what the context leaves
        max_tokens = max(1, max_model_len - longest_prompt - 1)
    if max_tokens + longest_prompt >= max_model_len:
        raise VLLMValidationError(
            f"the prompt ({longest_prompt} tokens) plus max_tokens={max_tokens} beam steps "
            f"exceed max_model_len={max_model_len}",
            parameter="max_tokens",
        )
    return BeamSearchParams(
        beam_width=req.n,
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        temperature=1.0 if req.temperature is None else req.temperature,
        length_penalty=req.length_penalty,
        include_stop_str_in_output=req.include_stop_str_in_output,
        early_stopping=req.early_stopping,
    )


async def beam_search_outputs(
    serving: BeamServing,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[dict[str, Any]],
    params: SamplingParams,
    rid: str,
) -> list[RequestOutput]:
    """One finished RequestOutput per prompt whose completions are its best beams."""
    llm = serving.llm
    ids = [list(p["prompt_token_ids"]) for p in prompts]
    bp = beam_params(req, params, max(len(t) for t in ids), llm.model_config.max_model_len)
    search = BeamSearch(ids, bp, serving.tokenizer.eos_token_id)
    step = search.step_params()
    n_step = 0
    while not search.done:
        pending = search.pending()
        streams = await serving._add_all(
            [{"prompt_token_ids": t} for t in pending], step, f"{rid}-beam{n_step}", req
        )
        finals = await final_outputs(streams)
        search.advance(
            [ro.outputs[0].logprobs[0] if ro.outputs[0].logprobs else {} for ro in finals]
        )
        n_step += 1
    return [
        _as_output(serving, req, f"{rid}-{i}", prompts[i], n, out.sequences)
        for i, (n, out) in enumerate(zip(search.prompt_lens, search.outputs()))
    ]


def _as_output(
    serving: BeamServing,
    req: CompletionRequest | ChatCompletionRequest,
    rid: str,
    prompt: dict[str, Any],
    prompt_len: int,
    beams: list[BeamSearchSequence],
) -> RequestOutput:
    want_logprobs = bool(req.logprobs)
    outs = []
    for i, beam in enumerate(beams):
        generated = beam.tokens[prompt_len:]
        text = serving.tokenizer.decode(generated, skip_special_tokens=req.skip_special_tokens)
        outs.append(
            CompletionOutput(
                index=i,
                text=text,
                token_ids=generated,
                cumulative_logprob=beam.cum_logprob,
                logprobs=list(beam.logprobs) if want_logprobs else None,
                finish_reason=beam.finish_reason or "length",
            )
        )
    return RequestOutput(
        request_id=rid,
        prompt=prompt.get("prompt"),
        prompt_token_ids=list(prompt["prompt_token_ids"]),
        outputs=outs,
        finished=True,
    )
