# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Turns per-step token outputs into RequestOutputs: detokenisation, stop strings, logprobs,
n > 1 fan-in, and the output kinds (cumulative, delta, final only)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import tokenizers

from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats
from vllm.v1.outputs import LogprobsLists


class IncrementalDetokenizer:
    """Output text of one sequence, decoded a few tokens at a time (vLLM's prefix/read offsets).

    Each step decodes only the window ids[prefix_offset:] and emits what it adds beyond the
    text of ids[prefix_offset:read_offset], so a step costs O(new tokens), not O(output). The
    window keeps one already-emitted token of left context, which is what decoders that treat
    the first token specially (a leading-space marker, a byte-level merge) need. Text ending in
    U+FFFD - a multi-byte character whose remaining bytes are still to come - is held back until
    it completes; finish() releases whatever is left, so the final text equals decoding all ids
    at once.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool):
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            # Only slow (Python) tokenizers read it; the default must not reach fast ones.
            self.kwargs["spaces_between_special_tokens"] = False
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix_text: str | None = ""  # decode(ids[prefix_offset:read_offset]), cached

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)

    def _window(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._prefix_text
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = None
        return full[len(prefix) :]

    def step(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty)."""
        self.ids.extend(new_ids)
        return self._window(final=False) if new_ids else ""

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end)."""
        return self._window(final=True) if self.read_offset < len(self.ids) else ""


@dataclass
class ChildState:
    index: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # tokens already emitted (delta mode)
    sent_text: int = 0  # characters already emitted (delta mode)
    sent_logprobs: int = 0
    final_sent: bool = False  # delta mode: the finished chunk went out
    # For the per-request metrics: when it was first scheduled, got its first / last token.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first sample)
    error: str | None = None  # why the engine finished it with finish_reason "error"

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}
        self._token_text_cache: dict[int, str] = {}

    def mark_scheduled(self, child_ids: list[str], now: float) -> None:
        """Record when each sequence was first scheduled (its queue time ends there)."""
        for cid in child_ids:
            rid = self.child_to_parent.get(cid)
            child = self.requests[rid].children.get(cid) if rid is not None else None
            if child is not None and child.scheduled_time is None:
                child.scheduled_time = now

    def record_finished(
        self, st: RequestState, child: ChildState, reason: str, now: float, stats: IterationStats
    ) -> None:
        """The finished-sequence stats of one child; the request's own once all finished."""
        first = child.first_token_time
        last = child.last_token_time if child.last_token_time is not None else now
        sched = child.scheduled_time if child.scheduled_time is not None else now
        stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=reason,
                e2e_latency=now - st.arrival_time,
                num_prompt_tokens=len(st.prompt_token_ids),
                num_generation_tokens=len(child.token_ids),
                max_tokens_param=child.params.max_tokens,
                queued_time=sched - st.arrival_time,
                prefill_time=(first if first is not None else now) - sched,
                inference_time=last - sched,
                decode_time=last - first if first is not None else 0.0,
            )
        )
        if all(c.finish_reason is not None or c is child for c in st.children.values()):
            stats.n_params_iter.append(st.params.n)
            stats.max_num_generation_tokens_iter.append(
                max(len(c.token_ids) for c in st.children.values())
            )

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for cid in state.children:
            self.child_to_parent[cid] = state.request_id

    def remove(self, request_id: str) -> None:
        st = self.requests.pop(request_id, None)
        if st is not None:
            for cid in st.children:
                self.child_to_parent.pop(cid, None)

    def _detokenize(self, child: ChildState, new_ids: list[int], finished: bool) -> None:
        """Append the text of this step's tokens to child.text, incrementally."""
        params = child.params
        if not params.detokenize or self.tokenizer is None:
            return
        if child.detokenizer is None:
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        child.text += child.detokenizer.step(new_ids)
        if finished:
            child.text += child.detokenizer.finish()

    def _token_texts(self, entries: list[LogprobsLists | None]) -> dict[int, str] | None:
        """The text of each token id in one step's logprob entries. A token's text never
        changes, so it is cached; the ids not seen before are decoded in one call."""
        if self.tokenizer is None:
            return None
        cache = self._token_text_cache
        new = list(
            dict.fromkeys(
                t for e in entries if e is not None for t in e.token_ids if t not in cache
            )
        )
        if new:
            backend = getattr(self.tokenizer, "_tokenizer", None)
            if isinstance(backend, tokenizers.Tokenizer) and not getattr(
                self.tokenizer, "clean_up_tokenization_spaces", False
            ):
                # The Rust tokenizer decodes a batch in one call; the Python wrapper would loop.
                texts = backend.decode_batch([[t] for t in new], skip_special_tokens=False)
            else:
                texts = self.tokenizer.batch_decode([[t] for t in new])
            cache.update(zip(new, texts))
        return cache

    def _to_logprob_dict(
        self, lp: LogprobsLists, texts: dict[int, str] | None
    ) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for rank, (tid, val) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tid in out:
                continue
            r = lp.sampled_rank if rank == 0 else rank
            out[tid] = Logprob(val, r, texts[tid] if texts is not None else None)
        return out

    def process(
        self,
        outputs: dict[str, EngineCoreOutput],
        now: float | None = None,
        stats: IterationStats | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs (their latencies and finished sequences go to `stats`).
        Returns (RequestOutputs to emit, child ids to abort because a stop string ended
        them)."""
        now = now if now is not None else time.time()
        stats = stats if stats is not None else IterationStats()
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for cid, out in outputs.items():
            rid = self.child_to_parent.get(cid)
            if rid is None:
                continue
            st = self.requests[rid]
            child = st.children[cid]
            if child.finish_reason is not None:
                continue
            touched[rid] = st
            if child.index == 0:
                st.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and child.index == 0:
                if st.prompt_logprobs is None:
                    st.prompt_logprobs = []
                if len(st.prompt_logprobs) < len(st.prompt_token_ids):
                    texts = self._token_texts(out.prompt_logprobs) if st.params.detokenize else None
                    st.prompt_logprobs += [
                        None if e is None else self._to_logprob_dict(e, texts)
                        for e in out.prompt_logprobs
                    ]
            finished = out.finish_reason is not None
            new_ids, stopped = out.new_token_ids, False
            if new_ids or finished:
                stop_token = out.finish_reason == "stop"  # EOS or a stop_token_ids entry
                new_ids, stopped = self._detokenize_and_stop(child, new_ids, finished, stop_token)
            if new_ids:
                if st.first_token_time is None:
                    st.first_token_time = now
                st.last_token_time = now
                st.num_generation_tokens += len(new_ids)
                # As vLLM: one TTFT per sequence, then one latency per step that brought it
                # tokens (a step's accepted drafts share it).
                if child.first_token_time is None:
                    child.first_token_time = now
                    stats.time_to_first_tokens_iter.append(now - st.arrival_time)
                elif child.last_token_time is not None:
                    stats.inter_token_latencies_iter.append(now - child.last_token_time)
                child.last_token_time = now
            child.token_ids.extend(new_ids)
            # A row that did not ask for logprobs gets None entries when its batch did: its
            # output keeps logprobs None (as vLLM), not [] and a cumulative 0.0.
            new_lps = out.new_logprobs
            if new_lps is not None and any(lp is not None for lp in new_lps):
                if child.logprobs is None:
                    child.logprobs, child.cumulative_logprob = [], 0.0
                new_lps = new_lps[: len(new_ids)]  # a stop string dropped the rest
                # detokenize=False: no text at all, decoded_token included (as vLLM).
                texts = self._token_texts(new_lps) if child.params.detokenize else None
                for lp in new_lps:
                    if lp is None:
                        continue
                    child.logprobs.append(self._to_logprob_dict(lp, texts))
                    child.cumulative_logprob = (child.cumulative_logprob or 0.0) + lp.logprobs[0]
            if stopped:
                if not finished:  # the engine is still generating it
                    to_abort.append(cid)
            elif finished:
                child.finish_reason = out.finish_reason
                child.stop_reason = out.stop_reason
                if out.error is not None:
                    st.error = out.error
            if child.finish_reason is not None:
                self.record_finished(st, child, child.finish_reason, now, stats)
        results = []
        for st in touched.values():
            ro = self._make_output(st)
            if ro is not None:
                results.append(ro)
            if st.finished:
                st.finished_time = now
        return results, to_abort

    def _detokenize_and_stop(
        self, child: ChildState, new_ids: list[int], finished: bool, stop_token: bool
    ) -> tuple[list[int], bool]:
        """Detokenize one step's tokens and look for a stop string. A step with accepted drafts
        brings several tokens: with stop strings they are taken one at a time, as steps of one
        token would be, and the first whose text completes a stop string ends the sequence -
        the tokens after it are dropped (the output equals the one without speculation). As
        vLLM: a stop token's own text (the engine finished on EOS or a stop_token_ids entry,
        `stop_token`) is left out unless include_stop_str_in_output, and a stop string in the
        last token of a step the engine finished by length still ends it as "stop".
        Returns (the tokens kept, whether a stop string ended the sequence)."""
        params = child.params
        text_ids = new_ids
        if stop_token and not params.include_stop_str_in_output:
            text_ids = new_ids[:-1]
        chunks = [[t] for t in text_ids] if params.stop and len(text_ids) > 1 else [text_ids]
        done = len(child.token_ids)
        for i, chunk in enumerate(chunks):
            old_len = len(child.text)
            self._detokenize(child, chunk, finished and i == len(chunks) - 1)
            done += len(chunk)
            if (
                params.stop
                # As vLLM: stop strings count once more than min_tokens tokens are out.
                and done > params.min_tokens
                and self._check_stop_strings(child, len(child.text) - old_len)
            ):
                return new_ids[: done - len(child.token_ids)], True
        return new_ids, False

    def _check_stop_strings(self, child: ChildState, num_new_chars: int) -> bool:
        """Find the first stop string that ends in the text this step added (earlier text
        was checked before, or came before min_tokens and does not count)."""
        if num_new_chars <= 0:
            return False
        text = child.text
        stops = child.params.stop or ()  # a list once SamplingParams is built
        best = None
        for s in stops:
            idx = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        child.text = text[: idx + len(s)] if child.params.include_stop_str_in_output else text[:idx]
        child.finish_reason = "stop"
        child.stop_reason = s
        return True

    def _make_output(self, st: RequestState) -> RequestOutput | None:
        kind = st.params.output_kind
        finished = st.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for child in sorted(st.children.values(), key=lambda c: c.index):
            if kind == RequestOutputKind.DELTA:
                if child.final_sent:
                    continue  # its finish was already reported
                child.final_sent = child.finish_reason is not None
                text = child.text
                # Hold back what could still become a stop string or an incomplete character.
                hold = (
                    0
                    if child.finish_reason
                    else max((len(s) - 1 for s in child.params.stop or ()), default=0)
                )
                end = len(text) - hold
                while (
                    end > child.sent_text and text[end - 1] == "\ufffd" and not child.finish_reason
                ):
                    end -= 1
                end = max(end, child.sent_text)
                delta_text = text[child.sent_text : end]
                child.sent_text = end
                toks = child.token_ids[child.sent_tokens :]
                child.sent_tokens = len(child.token_ids)
                lps = None
                if child.logprobs is not None:
                    lps = child.logprobs[child.sent_logprobs :]
                    child.sent_logprobs = len(child.logprobs)
                completions.append(
                    CompletionOutput(
                        child.index,
                        delta_text,
                        toks,
                        child.cumulative_logprob,
                        lps,
                        child.finish_reason,
                        child.stop_reason,
                    )
                )
            else:
                completions.append(
                    CompletionOutput(
                        child.index,
                        child.text,
                        list(child.token_ids),
                        child.cumulative_logprob,
                        list(child.logprobs) if child.logprobs is not None else None,
                        child.finish_reason,
                        child.stop_reason,
                    )
                )
        metrics = RequestMetrics(
            st.arrival_time, st.first_token_time, st.finished_time, st.num_generation_tokens
        )
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=st.prompt_logprobs,
            metrics=metrics,
            num_cached_tokens=st.num_cached_tokens,
            error=st.error,
        )
