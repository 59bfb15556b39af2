# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Incremental detokenisation equals decoding the whole output at once, on byte-level text that
splits characters across tokens (emoji, CJK, combining marks) and around special tokens; every
step decodes a bounded window, not the whole output."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from vllm.outputs import Logprob
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.core.sched.scheduler import EngineCoreOutput
from vllm.v1.engine.output_processor import (
    ChildState,
    IncrementalDetokenizer,
    OutputProcessor,
    RequestState,
)
from vllm.v1.outputs import LogprobsLists

TEXTS = [
    "Hello, world! 😀🎉 naïve café — “quotes” and ñandú.",
    "日本語のテキストと中文字符, 한국어 텍스트; emoji 👨‍👩‍👧‍👦 🇺🇳 and e\u0301 combining.",
    "<|im_start|>user\nwrite 🐍 code<|im_end|>\n<|im_start|>assistant\ndef f():  # ✓\n\treturn 42",
    "   leading spaces,\n\nnewlines\r\n and trailing  ",
]


@pytest.fixture(scope="module", params=["tiny_bpe", "smollm2"])
def tokenizer(request):
    name = "tokenizer_dir" if request.param == "tiny_bpe" else "smollm2_dir"
    return AutoTokenizer.from_pretrained(request.getfixturevalue(name))


def _chunks(ids: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("sizes", [(1,), (3, 1, 2)])  # one token a step; accepted drafts
def test_incremental_equals_full_decode(tokenizer, skip_special, sizes):
    split_chars = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special)
        det = IncrementalDetokenizer(tokenizer, skip_special, True)
        got = ""
        for chunk in _chunks(ids, sizes):
            delta = det.step(chunk)
            # An incomplete character is held back, never emitted as U+FFFD.
            assert "\ufffd" not in delta
            got += delta
            assert full.startswith(got)
        got += det.finish()
        assert got == full
        split_chars += sum("\ufffd" in tokenizer.decode([t]) for t in ids)
    # The texts do exercise characters split across byte-level tokens.
    assert split_chars > 0


def test_incomplete_character_at_the_end(tokenizer):
    """Generation stopping inside a multi-byte character: finish() releases the partial bytes,
    exactly as decoding everything would (U+FFFD)."""
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    ids = ids[:cut]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    det = IncrementalDetokenizer(tokenizer, True, True)
    got = "".join(det.step([t]) for t in ids)
    assert not got.endswith("\ufffd")
    assert got + det.finish() == full


class _CountingTokenizer:
    """Delegates to a real tokenizer and counts how many ids it is asked to decode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, **kwargs)

    def batch_decode(self, seqs, **kwargs):
        self.decoded_ids += sum(len(s) for s in seqs)
        return self.tok.batch_decode(seqs, **kwargs)


def _processor_run(
    tok, ids, kind, stop=None, logprobs=False, sizes=(1,), finish="length", **params_kw
):
    """Feed ids to an OutputProcessor in steps of `sizes` tokens (1: no speculation; more: a
    step's accepted drafts), the last step finished by `finish` ("stop": on a stop token)."""
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=len(ids), output_kind=kind, stop=stop, **params_kw)
    proc.add(RequestState("r", None, [1, 2], params, {"r": ChildState(0, params)}, 0.0))
    outs = []
    steps = _chunks(ids, sizes)
    for i, chunk in enumerate(steps):
        last = i == len(steps) - 1
        lp = None
        if logprobs:  # a distinct logprob per position, so a dropped one shows
            lp = [LogprobsLists([t, 5, 7], [-0.1 - t / 1e4, -2.0, -3.0], 1) for t in chunk]
        out = EngineCoreOutput("r", chunk, lp, finish_reason=finish if last else None)
        res, aborted = proc.process({"r": out})
        outs += res
        if aborted:
            assert aborted == ["r"]
            break
    return proc, outs


def test_output_processor_streams_deltas_that_add_up(tokenizer):
    ids = tokenizer.encode(TEXTS[1] + TEXTS[0], add_special_tokens=False)
    counting = _CountingTokenizer(tokenizer)
    _, outs = _processor_run(counting, ids, RequestOutputKind.DELTA)
    deltas = [o.outputs[0].text for o in outs]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    # Each step decodes a window of a few tokens: linear in the output, where re-decoding the
    # whole output every step would be ~len(ids)**2 / 2.
    assert counting.decoded_ids < 6 * len(ids)


def test_output_processor_cumulative_text_and_logprob_texts(tokenizer):
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    _, outs = _processor_run(tokenizer, ids, RequestOutputKind.CUMULATIVE, logprobs=True)
    final = outs[-1].outputs[0]
    assert final.text == tokenizer.decode(ids, skip_special_tokens=True)
    for t, lp in zip(ids, final.logprobs):
        assert lp[t] == Logprob(-0.1 - t / 1e4, 1, tokenizer.decode([t]))
        assert lp[7].decoded_token == tokenizer.decode([7])


def test_stop_string_with_incremental_text(tokenizer):
    text = "alpha beta 日本 gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, outs = _processor_run(tokenizer, ids, RequestOutputKind.CUMULATIVE, stop=["gam"])
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "gam"
    assert final.text == "alpha beta 日本 "


def _final(outs):
    o = outs[-1].outputs[0]
    return (
        list(o.token_ids),
        o.text,
        o.finish_reason,
        o.stop_reason,
        o.logprobs,
        o.cumulative_logprob,
    )


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 4])
def test_stop_string_inside_a_multi_token_step(tokenizer, include, min_tokens):
    """A step with accepted drafts brings several tokens at once; a stop string completed by one
    of them ends the output there, exactly as steps of one token would: the same token ids,
    text, logprobs and finish reason, the tokens after the stop dropped - whichever token of
    the step completes it, with min_tokens ending inside a step, and in the step the engine
    finishes by length."""
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu"
    ids = tokenizer.encode(text, add_special_tokens=False)
    words = text.split()
    cases = stopped = 0
    for stop in [words[1], words[6], "ta ", words[-4][:3], "a l"]:
        ref = _final(
            _processor_run(
                tokenizer,
                ids,
                RequestOutputKind.CUMULATIVE,
                [stop],
                True,
                min_tokens=min_tokens,
                include_stop_str_in_output=include,
            )[1]
        )
        # (a stop string in the first min_tokens tokens does not count: then none is found)
        stopped += ref[2] == "stop" and ref[3] == stop and len(ref[0]) < len(ids)
        for sizes in [(3,), (2, 4), (5, 1), (len(ids),)]:
            got = _final(
                _processor_run(
                    tokenizer,
                    ids,
                    RequestOutputKind.CUMULATIVE,
                    [stop],
                    True,
                    sizes=sizes,
                    min_tokens=min_tokens,
                    include_stop_str_in_output=include,
                )[1]
            )
            assert got == ref, (stop, sizes)
            cases += 1
    assert cases == 20 and stopped >= 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_left_out_as_vllm(tokenizer, include):
    """As vLLM: when the engine stops on a stop token (EOS or stop_token_ids), the token stays
    in token_ids but its text is left out of the output unless include_stop_str_in_output -
    whether it came alone or with accepted drafts."""
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    for sizes in [(1,), (2,), (len(ids),)]:
        _, outs = _processor_run(
            tokenizer,
            ids,
            RequestOutputKind.CUMULATIVE,
            sizes=sizes,
            finish="stop",
            include_stop_str_in_output=include,
        )
        o = outs[-1].outputs[0]
        assert list(o.token_ids) == ids and o.finish_reason == "stop"
        assert o.text == tokenizer.decode(ids if include else ids[:-1])


def test_stop_string_in_the_last_token_of_a_length_finish(tokenizer):
    """As vLLM: a stop string completed by the token that reached max_tokens still ends the
    output as "stop", its text cut there."""
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    stop = "ee"  # only at the very end: completed by the last token
    for sizes in [(1,), (len(ids),)]:
        _, outs = _processor_run(
            tokenizer, ids, RequestOutputKind.CUMULATIVE, stop=[stop], sizes=sizes
        )
        o = outs[-1].outputs[0]
        assert (o.finish_reason, o.stop_reason) == ("stop", stop)
        assert o.text == "one two thr" and list(o.token_ids) == ids
