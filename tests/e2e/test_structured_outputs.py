# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Structured outputs (xgrammar) offline, with and without speculation, at P = 1 and 2.

SmolLM2-135M-Instruct with its bundled EAGLE3 head and the bundled tiny DeepSeek-V3 with its
MTP heads: JSON-schema (validated with jsonschema), JSON-object, regex, choice and EBNF
requests, greedy and seeded, batched with a plain request, give exactly the same tokens with and
without speculation and at P = 2 as at P = 1, and every output is in its grammar. A regex whose
tokens the drafters never propose gives rejected drafts, not wrong text. A grammar that does not
compile is a ValueError naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from vllm import LLM, SamplingParams
from vllm.config import default_model_path
from vllm.model_zoo import zoo_path
from vllm.sampling_params import StructuredOutputsParams
from vllm.testing.engine_utils import spec_decode_counts

pytestmark = pytest.mark.usefixtures("pp_forkserver")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICE = ["red", "green", 'blue "sky"']
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
DIGITS = r"[0-9]{24}"

MODELS = {
    "smollm2_eagle3": ("smollm2-135m-instruct", "eagle3", "smollm2-135m-eagle3"),
    "tiny_mtp": (None, "mtp", None),
    "tiny_ngram": (None, "ngram", None),
}
DRAFTED = ["smollm2_eagle3", "tiny_mtp"]
"""The methods whose drafts come from a model (the grammar-blind drafts of the rejection test)."""


def _model(name: str) -> str:
    target = MODELS[name][0]
    if target is None:
        return str(default_model_path())
    try:
        return zoo_path(target)
    except Exception as e:  # noqa: BLE001 - the GGUF package is optional
        pytest.skip(f"{target} is not available: {e}")


def _spec(name: str, k: int) -> dict | None:
    if not k:
        return None
    _, method, head = MODELS[name]
    spec: dict = {
        "method": method,
        "num_speculative_tokens": k,
        "adaptive_num_speculative_tokens": False,
    }
    if head:
        spec["model"] = zoo_path(head)
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    return spec


def _requests(llm: LLM, name: str):
    if name == "smollm2_eagle3":
        tok = llm.get_tokenizer()

        def chat(q: str) -> str:
            return tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )

        prompts = [
            chat("Describe a person as JSON with name, age and tags."),
            chat('Repeat exactly: {"answer": 42}'),
            chat("Write a product code."),
            chat("What color is the sky?"),
            chat("Write a sum of small numbers."),
            chat("Tell me a story."),
            chat("Count to ten."),
        ]
    else:
        prompts = [
            "def person():\n    return ",
            "config = ",
            "code = '",
            "color = ",
            "total = ",
            "for i in range(10):\n",
            "x = ",
        ]

    def so(**kw) -> StructuredOutputsParams:
        return StructuredOutputsParams(**kw)

    sps = [
        # Without free whitespace: a tiny model could fill max_tokens with it (vLLM's default
        # allows it; the json_object case below runs with the default).
        SamplingParams(
            temperature=0,
            max_tokens=64,
            structured_outputs=so(json=SCHEMA, disable_any_whitespace=True),
        ),
        SamplingParams(temperature=0, max_tokens=128, structured_outputs=so(json_object=True)),
        SamplingParams(temperature=0.9, seed=7, max_tokens=16, structured_outputs=so(regex=REGEX)),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=so(choice=CHOICE)),
        SamplingParams(temperature=0.7, seed=3, max_tokens=24, structured_outputs=so(grammar=EBNF)),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # plain
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=so(regex=DIGITS)),
    ]
    return prompts, sps


_RUNS: dict = {}


def _run(name: str, k: int, pp: int, tp: int = 1):
    key = (name, k, pp, tp)
    if key not in _RUNS:
        llm = LLM(
            model=_model(name),
            speculative_config=_spec(name, k),
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=8,
            disable_log_stats=False,
        )
        try:
            prompts, sps = _requests(llm, name)
            outs = llm.generate(prompts, sps, use_tqdm=False)
            _RUNS[key] = (
                [
                    (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
                    for o in outs
                ],
                spec_decode_counts(llm),
                {
                    (m.name, m.labels["proposer"]): m.value
                    for m in llm.get_metrics()
                    if "proposer" in m.labels
                },
            )
        finally:
            llm.shutdown()
    return _RUNS[key]


def _check_grammar(outs: list[tuple[list[int], str, str]]) -> None:
    texts = [t for _, t, _ in outs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    if outs[1][2] == "stop":
        assert isinstance(json.loads(texts[1]), dict), texts[1]
    else:  # a tiny model may write one endless string: the object is unfinished at max_tokens
        assert texts[1].startswith("{"), texts[1]
    assert re.fullmatch(REGEX, texts[2]), texts[2]
    assert texts[3] in CHOICE, texts[3]
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", texts[4]), texts[4]
    assert re.fullmatch(DIGITS, texts[6]), texts[6]


def _param(name: str, *rest, id: str):
    """SmolLM2 runs (~1 min each on 2 cores) are slow-marked like the repo's other SmolLM2
    tests; the bundled tiny model covers the same ground by default."""
    marks = (pytest.mark.slow,) if name.startswith("smollm2") else ()
    return pytest.param(name, *rest, marks=marks, id=id)


CASES = [
    ("smollm2_eagle3", 3, 1),
    ("smollm2_eagle3", 3, 2),
    ("smollm2_eagle3", 0, 2),
    ("tiny_mtp", 2, 1),
    ("tiny_mtp", 2, 2),
    ("tiny_mtp", 0, 2),
    ("tiny_ngram", 3, 1),
    ("tiny_ngram", 3, 2),
]


@pytest.mark.parametrize("name", [_param(n, id=n) for n in DRAFTED])
def test_outputs_follow_their_grammars(name) -> None:
    outs, _, _ = _run(name, 0, 1)
    _check_grammar(outs)


@pytest.mark.parametrize("name,k,pp", [_param(n, k, p, id=f"{n}-k{k}-pp{p}") for n, k, p in CASES])
def test_identical_with_and_without_speculation(name, k, pp) -> None:
    ref, _, _ = _run(name, 0, 1)
    outs, counts, _ = _run(name, k, pp)
    assert [o[0] for o in outs] == [o[0] for o in ref]
    _check_grammar(outs)
    if k:
        assert counts[1] > 0 and counts[2] < counts[1], counts  # drafts, some rejected


def test_json_schema_with_mtp_and_grammar_aware_drafting_under_tp2() -> None:
    """TP = 2 (the bundled model's MLA heads and experts split over two worker processes),
    its MTP head drafting under the grammar (grammar_aware_drafting, the default): the same
    tokens as one worker without speculation, every output in its grammar (the schema's JSON
    validated), and both the head's drafts and the grammar's forced tokens verified."""
    ref, _, _ = _run("tiny_mtp", 0, 1)
    outs, counts, by = _run("tiny_mtp", 2, 1, tp=2)
    assert [o[0] for o in outs] == [o[0] for o in ref]
    _check_grammar(outs)
    assert counts[1] > 0 and counts[2] > 0, counts
    drafts = "vllm:spec_decode_num_drafts_per_proposer"
    assert by[(drafts, "mtp")] > 0 and by[(drafts, "jump_forward")] > 0, by


@pytest.mark.parametrize("aware", [False, True], ids=["plain", "grammar_aware"])
@pytest.mark.parametrize("name", [_param(n, id=n) for n in DRAFTED])
def test_forbidden_drafts_are_never_emitted(name, aware) -> None:
    """Only digits are allowed; the drafters propose text. Without grammar-aware drafting the
    forbidden drafts are verified and rejected (counted); with it (the default) they are cut
    before verification (counted by the grammar state) and a draft model proposes digits
    instead. Either way the output is the grammar's, equal to the run without speculation."""
    model = _model(name)
    prompt = "Tell me about the weather in Paris."
    sp = SamplingParams(
        temperature=0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{20}"),
    )
    texts, counts, cut, masked = [], [], 0, 0
    for k in (0, 3):
        spec = _spec(name, k)
        if spec is not None:
            spec["grammar_aware_drafting"] = aware
        llm = LLM(model=model, speculative_config=spec, max_model_len=256)
        try:
            if name == "tiny_mtp":
                out = llm.generate(["def weather(city):\n    "], sp, use_tqdm=False)[0]
            else:
                out = llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False)[0]
            texts.append(out.outputs[0].text)
            counts.append(spec_decode_counts(llm))
            if k:
                runner = llm.llm_engine.executor.worker.model_runner
                cut = runner.structured.num_forbidden_drafts
                masked = runner.structured.num_masked_draft_rows
        finally:
            llm.shutdown()
    assert texts[0] == texts[1] and re.fullmatch("[0-9]{20}", texts[1]), texts
    drafted, accepted = counts[1][1], counts[1][2]
    if not aware:
        # Rejections, not a share: how often a head guesses the digits right is its quality
        # (the shipped SmolLM2 head accepts half of its drafts here).
        assert drafted > 0 and accepted < drafted, counts[1]
        assert cut == masked == 0
    else:
        # The draft model chose under the grammar's mask: what it verifies is all digits.
        assert drafted > 0 and masked > 0 and cut == 0, (counts[1], cut, masked)


@pytest.mark.parametrize(
    "so, what",
    [
        (dict(regex="[0-9"), "regex"),
        (dict(json="{not json"), "json"),
        (dict(grammar="root ::= "), "grammar"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json"),
    ],
)
def test_bad_grammar_is_a_value_error_naming_it(so, what) -> None:
    llm = _bad_llm()
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
    with pytest.raises(ValueError, match=rf"structured_outputs\.{what} does not compile"):
        llm.generate(["x = "], sp, use_tqdm=False)
    ok = llm.generate(["x = "], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2


def test_structured_outputs_params_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(TypeError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


_BAD_LLM: list = []


def _bad_llm() -> LLM:
    if not _BAD_LLM:
        _BAD_LLM.append(LLM(max_model_len=128))
    return _BAD_LLM[0]


@pytest.fixture(scope="module", autouse=True)
def _shutdown_bad_llm():
    yield
    for llm in _BAD_LLM:
        llm.shutdown()
    _BAD_LLM.clear()


def test_bitmask_rows_follow_the_drafts_and_roll_back() -> None:
    """Worker level: row j's mask is the grammar's after drafts 0 .. j - 1; a forbidden draft
    leaves the rows after it open; the matcher ends where it started."""
    import torch
    import xgrammar as xgr

    from vllm.v1.worker.gpu.sample.structured_outputs import StructuredOutputStates

    model = str(default_model_path())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    V = len(tok)
    so = StructuredOutputStates(model, V)
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab[0-9]+"))
    so.add(0, sp, [])
    a, b = (tok.encode(c, add_special_tokens=False) for c in ("a", "b"))
    assert len(a) == len(b) == 1
    a_id, b_id = a[0], b[0]
    digit = tok.encode("7", add_special_tokens=False)[0]

    def rows(drafts: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(drafts) + 1, V)
        inputs = np.array([0, *drafts])
        return so.apply_bitmasks(logits, np.zeros(len(drafts) + 1, dtype=np.int64), inputs)

    def allowed(row: torch.Tensor) -> set[int]:
        return set(torch.isfinite(row).nonzero().flatten().tolist())

    got = rows([a_id, b_id])
    assert a_id in allowed(got[0]) and b_id not in allowed(got[0])
    assert b_id in allowed(got[1]) and a_id not in allowed(got[1])
    assert digit in allowed(got[2]) and not {a_id, b_id} & allowed(got[2])
    # A forbidden first draft: row 0 masked, the rows after it left open (never emitted).
    got = rows([b_id, b_id])
    assert b_id not in allowed(got[0])
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    # Rolled back: the matcher still expects "a" first.
    bm = xgr.allocate_token_bitmask(1, V)
    so.matchers[0].fill_next_token_bitmask(bm, 0)
    probe = torch.zeros(1, V)
    xgr.apply_token_bitmask_inplace(probe, bm, vocab_size=V)
    assert a_id in allowed(probe[0]) and b_id not in allowed(probe[0])
    # The step's emitted tokens advance it.
    so.accept(np.array([0]), np.array([[a_id, b_id, -1]]), np.array([2]))
    got = rows([])
    assert digit in allowed(got[0]) and a_id not in allowed(got[0])


@pytest.mark.parametrize("engine_wide", [False, True])
def test_json_allows_whitespace_unless_disabled(engine_wide) -> None:
    """As vLLM's xgrammar backend: a JSON schema allows whitespace between tokens by default;
    disable_any_whitespace (the request's, or structured_outputs_config's for every request)
    takes it away. Checked on the compiled grammar's matcher."""
    import xgrammar as xgr

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.structured_output import get_backend

    model = str(default_model_path())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    backend = get_backend(model, len(tok), tok)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(so: StructuredOutputsParams, text: str) -> bool:
        matcher = xgr.GrammarMatcher(backend.compile(so))
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))

    # Without free whitespace xgrammar writes JSON as json.dumps does (", " and ": ").
    spaced, tight = '{ "a" :  1 }', '{"a": 1}'
    if engine_wide:
        # The engine applies structured_outputs_config to each request's params.
        cfg = EngineArgs(
            model=model, structured_outputs_config={"disable_any_whitespace": True}
        ).create_engine_config()
        so = StructuredOutputsParams(json=schema)
        so.disable_any_whitespace |= cfg.structured_outputs_config.disable_any_whitespace
        assert not accepts(so, spaced) and accepts(so, tight)
        return
    assert accepts(StructuredOutputsParams(json=schema), spaced)
    strict = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert not accepts(strict, spaced) and accepts(strict, tight)
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert not accepts(closed, '{"a": 1, "b": 2}') and accepts(closed, '{"a": 1}')


LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string"},
        "shipping_address_first_line": {"type": "string"},
        "total_order_amount_in_cents": {"type": "integer"},
    },
    "required": [
        "customer_full_name",
        "shipping_address_first_line",
        "total_order_amount_in_cents",
    ],
}


@pytest.mark.parametrize("spec", ["jump_forward", "mtp"])
def test_jump_forward_tokens_are_verified(spec) -> None:
    """A schema with long fixed keys and no free whitespace: the grammar forces each key, and
    those tokens are proposed as drafts (alone, or instead of MTP's where the grammar forces
    them). They are verified like drafts, so the model writes their KV: every token after a
    forced run - the values - is still the model's own, and the text equals the run without
    speculation."""
    sp = SamplingParams(
        temperature=0,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=LONG_KEYS, disable_any_whitespace=True),
    )
    prompts = ["config = ", "def order():\n    return ", "x = "]
    cfg = {"method": spec, "num_speculative_tokens": 8, "adaptive_num_speculative_tokens": False}
    outs, counts, forced = [], [], 0
    for s in (None, cfg):
        llm = LLM(model=str(default_model_path()), speculative_config=s, max_model_len=256)
        try:
            got = llm.generate(prompts, sp, use_tqdm=False)
            outs.append([o.outputs[0].text for o in got])
            counts.append(spec_decode_counts(llm))
            if s is not None:
                forced = (
                    llm.llm_engine.executor.worker.model_runner.structured.num_jump_forward_tokens
                )
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]
    for text in outs[1]:
        if text.endswith("}"):
            jsonschema.validate(json.loads(text), LONG_KEYS)
        assert '"customer_full_name":' in text, text
    drafted, accepted = counts[1][1], counts[1][2]
    assert forced > 0 and drafted > 0 and accepted > 0, (forced, counts[1])
    if spec == "jump_forward":
        assert drafted == forced  # nothing else drafts
