# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Beam search as vLLM runs it: each step every live beam is extended by one engine step
that returns its top 2 * beam_width next tokens (prefix caching makes the shared prefixes
cheap); the beam_width best candidates by length-penalised score live on, candidates ending
in EOS are set aside as finished. `BeamSearch` holds that state and is driven by whoever can
run the engine (the offline `LLM` or the server's async engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.outputs import Logprob
from vllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt first), the logprobs of each step's candidates."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """cum_logprob / length ** length_penalty, the length counting the prompt and not a final
    EOS (vLLM's score; HF's length_penalty has the same meaning)."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


class BeamSearch:
    """The beams of a batch of prompts. `pending()` lists the token sequences to extend by one
    step, `advance()` takes each one's candidate logprobs, until `done`."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None
    ):
        self.params = params
        self.eos = eos_token_id
        self.prompt_lens = [len(p) for p in prompts]
        self.beams = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def step_params(self) -> SamplingParams:
        """What one extension step asks the engine for: the top 2 * beam_width candidates."""
        p = self.params
        return SamplingParams(
            n=1,
            temperature=p.temperature,
            max_tokens=1,
            logprobs=2 * p.beam_width,
            ignore_eos=True,
            detokenize=False,
        )

    def _score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty
        )

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def pending(self) -> list[list[int]]:
        return [b.tokens for beams in self.beams for b in beams]

    def pending_prompts(self) -> list[int]:
        """The prompt index of each of pending()'s sequences."""
        return [i for i, beams in enumerate(self.beams) for _ in beams]

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """candidates[j]: the next-token logprobs of pending()[j]."""
        width = self.params.beam_width
        j = 0
        for i, beams in enumerate(self.beams):
            grown = []
            for beam in beams:
                lps = candidates[j]
                j += 1
                for tid, lp in lps.items():
                    new = BeamSearchSequence(
                        tokens=beam.tokens + [tid],
                        logprobs=beam.logprobs + [lps],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if tid == self.eos and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.completed[i].append(new)
                    else:
                        grown.append(new)
            grown.sort(key=self._score, reverse=True)
            self.beams[i] = grown[:width]
            if self.params.early_stopping and len(self.completed[i]) >= width:
                self.beams[i] = []  # enough finished candidates: stop this prompt
        self.steps += 1

    def outputs(self) -> list[BeamSearchOutput]:
        """The beam_width best of the finished and the live beams of each prompt."""
        out = []
        for beams, done in zip(self.beams, self.completed):
            for b in beams:
                b.finish_reason = b.finish_reason or "length"
            best = sorted(done + beams, key=self._score, reverse=True)[: self.params.beam_width]
            out.append(BeamSearchOutput(sequences=best))
        return out
