# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Qwen3.5 as a multimodal target: images through the vision tower, placeholder expansion,
M-RoPE, merged embeddings, against HF transformers' Qwen3_5ForConditionalGeneration on the same
tiny random checkpoint (fp32), at P = 1 and P = 2, with chunked prefill across an image.

The fixture's vision weights are large (std 0.2) and its images' patch grids are smaller, equal
to and larger than the learned 8x8 position grid, so that every part of the vision path moves
the greedy text: test_each_vision_module_moves_the_text breaks HF's reference one module at a
time and asserts the text changes, so the parity tests would catch the same break here."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.testing import qwen3_5_checkpoints as q35

COMMON = dict(dtype="float32", max_model_len=256, block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PH = q35.IMAGE_PLACEHOLDER


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return q35.make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"))


# (prompt, images): one image, two images of different sizes, text only. Patch grids (rows x
# cols, 8-pixel patches) against the learned 8x8 grid: 6x8 (fewer rows), 8x8 (equal), 12x16
# (larger), 2x6 after the resize to the minimum pixel count.
CASES = [
    ("describe " + PH + " now", [q35.make_test_image(0, (64, 48))]),
    (
        "a " + PH + " and " + PH + " compare",
        [q35.make_test_image(1, (64, 64)), q35.make_test_image(2, (128, 96))],
    ),
    ("plain text prompt", []),
    ("tall " + PH + " here", [q35.make_test_image(3, (40, 16))]),
]
IMAGE_CASES = [c for c in CASES if c[1]]


def _prompt(text, images):
    p: dict = {"prompt": text}
    if images:
        p["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return p


def _run(llm: LLM, cases, sp=GREEDY) -> list[list[int]]:
    outs = llm.generate([_prompt(t, im) for t, im in cases], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def hf_refs(vl_dir) -> list[list[int]]:
    return [q35.hf_vl_greedy(vl_dir, t, im, GREEDY.max_tokens) for t, im in CASES]


def test_images_change_the_output(vl_dir, hf_refs):
    """The reference is sensitive to the image's pixels (else parity would prove nothing)."""
    other = q35.hf_vl_greedy(
        vl_dir, CASES[0][0], [q35.make_test_image(7, (64, 48))], GREEDY.max_tokens
    )
    assert other != hf_refs[0]


# ---- each module of the vision path moves the text --------------------------------------------


def _hf_module():
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    return m


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _hook(module, fn, pre: bool = False):
    handle = module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
    try:
        yield
    finally:
        handle.remove()


def _break(name: str, model):
    """A context in which HF's model computes one part of the vision path wrongly."""
    m = _hf_module()
    visual = model.model.visual
    cfg = visual.config
    c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
    side = visual.num_grid_per_side
    if name == "patch pixel layout":  # (T, C) instead of (C, T) inside a patch
        return _hook(
            visual.patch_embed,
            lambda _m, a: (a[0].reshape(-1, t, c, p, p).transpose(1, 2).reshape(a[0].shape),),
            pre=True,
        )
    if name in ("position grid resampling", "position grid transposed"):
        interp = m.get_vision_interpolation_indices_and_weights

        def wrong(*args, **kwargs):
            if name == "position grid resampling":
                kwargs["align_corners"] = False
                return interp(*args, **kwargs)
            idx, w = interp(*args, **kwargs)
            return (idx % side) * side + idx // side, w

        return _patched(m, "get_vision_interpolation_indices_and_weights", wrong)
    if name == "rotary rows and columns swapped":
        return _patched(
            m.Qwen3_5VisionRotaryEmbedding,
            "recomposition_frequencies",
            lambda _self, f: torch.cat([f[:, 1], f[:, 0]] * 2, dim=-1),
        )
    if name == "no vision rotary":
        return _patched(m, "apply_rotary_pos_emb_vision", lambda q, k, cos, sin: (q, k))
    if name.startswith("vision block"):
        block = visual.blocks[int(name.split()[-1])]
        return _hook(block, lambda _m, a, out: a[0])
    if name == "merge window order":  # the 4 patches of a merge window taken in another order
        return _hook(
            visual.merger,
            lambda _m, a: (
                a[0].reshape(-1, 2, 2, a[0].shape[-1]).transpose(1, 2).reshape(a[0].shape),
            ),
            pre=True,
        )
    if name == "attention across images":
        seqlens = m.get_vision_attention_seqlens

        def one_sequence(grid_thw, *args, **kwargs):
            cu, _ = seqlens(grid_thw, *args, **kwargs)
            return cu[[0, -1]], int(cu[-1])

        return _patched(m, "get_vision_attention_seqlens", one_sequence)
    if name == "image features shifted by one token":

        def shifted(_m, _a, out):
            out.pooler_output = out.pooler_output.roll(1, dims=0)
            return out

        return _hook(visual, shifted)
    if name in ("M-RoPE as 1-D positions", "M-RoPE rows and columns swapped"):
        rope_index = model.model.get_rope_index

        def wrong_index(input_ids, *args, **kwargs):
            pos, delta = rope_index(input_ids, *args, **kwargs)
            if name == "M-RoPE as 1-D positions":
                n = input_ids.shape[-1]
                return torch.arange(n).view(1, 1, n).expand_as(pos).clone(), delta * 0
            return pos[[0, 2, 1]], delta

        return _patched(model.model, "get_rope_index", wrong_index)
    raise AssertionError(name)


BREAKS = [
    "patch pixel layout",
    "position grid resampling",
    "position grid transposed",
    "rotary rows and columns swapped",
    "no vision rotary",
    "vision block 0",
    "vision block 1",
    "merge window order",
    "attention across images",
    "image features shifted by one token",
    "M-RoPE as 1-D positions",
    "M-RoPE rows and columns swapped",
]


def test_each_vision_module_moves_the_text(vl_dir, hf_refs):
    """HF's greedy text with one module of the vision path computed wrongly differs from the
    correct text on at least one of the cases: an engine that got that module wrong would fail
    test_greedy_matches_hf. (With small vision weights several of these left the text as is.)
    The positions' delta after the prompt is compared with HF's directly
    (test_placeholder_expansion_and_positions): HF's generate continues decode positions from
    the prompt's own, so breaking its delta would not show here."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    refs = {i: hf_refs[i] for i, (_, im) in enumerate(CASES) if im}
    unmoved = []
    for name in BREAKS:
        with _break(name, model):
            got = {
                i: q35.hf_vl_greedy(vl_dir, *CASES[i], GREEDY.max_tokens, model=model) for i in refs
            }
        if got == refs:
            unmoved.append(name)
    assert not unmoved, f"the fixture does not notice: {unmoved}"


@pytest.mark.parametrize("pp", [1, 2])
def test_greedy_matches_hf(vl_dir, hf_refs, pp):
    """One and two images and a text-only prompt in one batch, with prompts in 8-token chunks
    (image placeholder runs split across steps); the encoder runs once per image."""
    llm = LLM(
        model=vl_dir,
        pipeline_parallel_size=pp,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        **COMMON,
    )
    try:
        assert _run(llm, CASES) == hf_refs
        if pp == 1:
            model = llm.llm_engine.executor.worker.model_runner.model
            assert model.num_encoded_images == 4
        else:
            # Pixel values reach the first stage only: stage 1 needs the placeholder runs and
            # M-RoPE positions alone (the outputs above are unchanged without them).
            received = [s["mm_pixel_bytes"] for s in llm.llm_engine.executor.comm_stats()]
            assert received == [_pixel_bytes(vl_dir), 0]
    finally:
        llm.shutdown()


def _pixel_bytes(path: str) -> int:
    """float32 bytes of every image's pixel values, from transformers' own image processor."""
    import transformers

    proc = transformers.AutoImageProcessor.from_pretrained(path)
    total = 0
    for _, images in IMAGE_CASES:
        pix = proc(images=images, return_tensors="np")["pixel_values"]
        total += pix.size * 4
    return total


def test_placeholder_expansion_and_positions(vl_dir):
    """Each <|image_pad|> becomes grid_t * grid_h * grid_w / 4 tokens; M-RoPE positions equal
    transformers' get_rope_index."""
    import transformers

    llm = LLM(model=vl_dir, **COMMON)
    try:
        text, images = CASES[1]
        _, ids, mm = llm.llm_engine.process_prompt_mm(_prompt(text, images))
    finally:
        llm.shutdown()
    assert mm is not None and len(mm.features) == 2
    for f in mm.features:
        assert f.length == f.grid_thw[0] * f.grid_thw[1] * f.grid_thw[2] // 4
        assert ids[f.offset : f.offset + f.length] == [ids[f.offset]] * f.length
    hf = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    t = torch.tensor([ids])
    grid = torch.tensor([f.grid_thw for f in mm.features])
    pos, delta = hf.model.get_rope_index(t, (t == ids[mm.features[0].offset]).int(), grid)
    assert pos[:, 0].tolist() == mm.mrope_positions.tolist()
    assert int(delta) == mm.mrope_delta


@pytest.fixture(scope="module")
def vl_attn_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Full attention in every layer: not hybrid, so prefix caching is on."""
    return q35.make_qwen3_5_vl(
        tmp_path_factory.mktemp("qwen3_5_vl_attn"), layer_types=["full_attention"] * 4, seed=3
    )


def test_prefix_cache_keys_images_by_content(vl_attn_dir):
    """Same text, same image size, different pixels: the placeholder tokens are equal, but
    their blocks hash by the image content, so the second request reuses only the text blocks
    before the image and gets its own (HF's) output; the same image again hits the cache."""
    text = "some shared text before the image " + PH + " and after it, more text to read"
    a, b = q35.make_test_image(10, (64, 48)), q35.make_test_image(11, (64, 48))
    refs = [q35.hf_vl_greedy(vl_attn_dir, text, [im], GREEDY.max_tokens) for im in (a, b)]
    assert refs[0] != refs[1]
    llm = LLM(model=vl_attn_dir, enable_prefix_caching=True, **COMMON)
    try:
        _, ids, mm = llm.llm_engine.process_prompt_mm(_prompt(text, [a]))
        assert mm is not None
        image_start = mm.features[0].offset
        got, cached = [], []
        for im in (a, b, a):
            out = llm.generate(_prompt(text, [im]), GREEDY, use_tqdm=False)[0]
            got.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens)
    finally:
        llm.shutdown()
    assert got == [refs[0], refs[1], refs[0]]
    block = COMMON["block_size"]
    assert cached[1] == image_start // block * block  # only the text blocks before the image
    assert cached[2] == (len(ids) - 1) // block * block  # the whole prompt but its last block


# ---- MTP on the multimodal target -------------------------------------------------------------


@pytest.fixture(scope="module")
def vl_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The VL checkpoint with one random MTP layer."""
    return q35.make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl_mtp"), mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def vl_near_self_draft_dir(tmp_path_factory: pytest.TempPathFactory, vl_mtp_dir) -> str:
    """Target layers kept at scale 0.3 (images still steer it); the MTP head predicts from its
    own input embedding only, so its drafts are partly accepted."""
    return q35.make_qwen3_5_mtp_self_draft(
        tmp_path_factory.mktemp("qwen3_5_vl_near"), vl_mtp_dir, target_scale=0.3
    )


def _spec(path, cases, pp, k=2):
    llm = LLM(
        model=path,
        speculative_config={
            "method": "mtp",
            "num_speculative_tokens": k,
            "adaptive_num_speculative_tokens": False,
        },
        pipeline_parallel_size=pp,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        **COMMON,
    )
    try:
        outs = _run(llm, cases)
        m = {x.name: x for x in llm.get_metrics()}
        counts = (
            m["vllm:spec_decode_num_draft_tokens"].value,
            m["vllm:spec_decode_num_accepted_tokens"].value,
        )
        gathered = None
        if pp == 1:
            spec = llm.llm_engine.executor.worker.model_runner.speculator
            gathered = spec.num_mm_rows_gathered
        return outs, counts, gathered
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model", ["vl_near_self_draft_dir", "vl_mtp_dir"])
def test_mtp_on_multimodal_target(request, model):
    """MTP drafting for a target with images: lossless (HF's greedy tokens) at P = 1 and P = 2.
    At P = 1 the draft's first pass reads the encoder outputs at image-placeholder inputs (the
    binding's gather); at P = 2 the draft runs on the last stage, which has no encoder outputs,
    and the guard keeps it from gathering (without the guard that stage would try to run an
    encoder it does not hold and the step fails). The near-self draft's proposals depend only
    on their own input tokens, so its acceptance counts are equal across P."""
    path = request.getfixturevalue(model)
    refs = [q35.hf_vl_greedy(path, t, im, GREEDY.max_tokens) for t, im in CASES]
    p1, counts1, gathered = _spec(path, CASES, 1)
    p2, counts2, _ = _spec(path, CASES, 2)
    assert p1 == p2 == refs
    assert gathered is not None and gathered > 0
    drafted, accepted = counts1
    assert drafted > 0
    if model == "vl_near_self_draft_dir":
        assert counts2 == counts1
        assert 0 < accepted < drafted


@pytest.fixture(scope="module")
def vl_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return q35.make_qwen3_5_vl(tmp_path_factory.mktemp("vl_moe"), moe=True, seed=4)


@pytest.mark.parametrize("pp", [1, 2])
def test_moe_variant_matches_hf(vl_moe_dir, pp):
    """Qwen3_5MoeForConditionalGeneration: the same tower next to the MoE text model, every
    case of the dense test, chunked prefill inside the image runs."""
    refs = [q35.hf_vl_greedy(vl_moe_dir, t, im, GREEDY.max_tokens) for t, im in CASES]
    llm = LLM(
        model=vl_moe_dir,
        pipeline_parallel_size=pp,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        **COMMON,
    )
    try:
        assert _run(llm, CASES) == refs
    finally:
        llm.shutdown()


def _chat(images: list, text: str) -> list[dict]:
    parts: list[dict] = [{"type": "image_pil", "image_pil": im} for im in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def test_chat_renders_images_as_the_template_does(vl_dir):
    """LLM.chat with image parts and a template that loops over content parts (as Qwen-VL's
    do): the template places the image tokens, so the prompt is HF's rendering of the same
    messages and the text HF's greedy answer. Forcing the "string" format (image placeholder
    and text joined by a newline, for templates that print content whole) gives another
    prompt - the difference auto-detection makes."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(vl_dir)
    images = [q35.make_test_image(0, (64, 48)), q35.make_test_image(2, (128, 96))]
    hf_messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Both?"}],
        }
    ]
    text = tok.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    assert "<|vision_end|><|vision_start|>" in text and "<|vision_end|>Both?" in text
    want = q35.hf_vl_greedy(vl_dir, text, images, GREEDY.max_tokens)
    llm = LLM(model=vl_dir, **COMMON)
    try:
        auto = llm.chat(_chat(images, "Both?"), GREEDY, use_tqdm=False)[0]
        string = llm.chat(
            _chat(images, "Both?"), GREEDY, use_tqdm=False, chat_template_content_format="string"
        )[0]
        with pytest.raises(ValueError, match="chat_template_content_format"):
            llm.chat(_chat(images, "x"), GREEDY, chat_template_content_format="list")
    finally:
        llm.shutdown()
    assert list(auto.outputs[0].token_ids) == want
    assert auto.prompt_token_ids != string.prompt_token_ids


def test_remote_image_urls_only_for_allowed_hosts(vl_dir):
    """An http image URL is fetched only when its host is allowed; the fetched image gives the
    same answer as the same bytes sent inline."""
    import base64
    import http.server
    import io
    import threading

    image = q35.make_test_image(9)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    body = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}/cat.png"
    inline = "data:image/png;base64," + base64.b64encode(body).decode()

    def msgs(u):
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": u}},
                    {"type": "text", "text": "what?"},
                ],
            }
        ]

    try:
        closed = LLM(model=vl_dir, **COMMON)
        try:
            with pytest.raises(ValueError, match="remote image URLs are not fetched"):
                closed.chat(msgs(url), GREEDY, use_tqdm=False)
            want = closed.chat(msgs(inline), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            closed.shutdown()
        opened = LLM(model=vl_dir, allowed_media_domains=["127.0.0.1"], **COMMON)
        try:
            got = opened.chat(msgs(url), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            opened.shutdown()
    finally:
        srv.shutdown()
    assert list(got) == list(want)


def test_preemption_with_images(vl_dir, hf_refs):
    """Too few KV blocks for the batch: requests with images are preempted and recomputed (the
    images encoded again where their outputs were dropped), outputs still HF's."""
    probe = LLM(model=vl_dir, **COMMON)
    runner = probe.llm_engine.executor.worker.model_runner
    per_block, states = runner.kv_cache_bytes_per_block(), runner.state_cache_bytes()
    probe.shutdown()
    cases = CASES * 2
    llm = LLM(
        model=vl_dir,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=states + per_block * 16,  # the longest request needs ~12 of them
        **{**COMMON, "max_model_len": 16 * 8},
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = _run(llm, cases, sp)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    refs = [q35.hf_vl_greedy(vl_dir, t, im, 24) for t, im in CASES]
    assert refs[0][: GREEDY.max_tokens] == hf_refs[0]
    assert outs == refs * 2


def test_draft_first_pass_reads_the_encoder_outputs(vl_mtp_dir):
    """P = 1: the inputs the MTP draft's first pass embeds at image-placeholder positions are
    the image's encoder outputs (every row of them), not the placeholder token's embedding."""
    llm = LLM(
        model=vl_mtp_dir,
        speculative_config={
            "method": "mtp",
            "num_speculative_tokens": 1,
            "adaptive_num_speculative_tokens": False,
        },
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        **COMMON,
    )
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        seen: list[torch.Tensor] = []
        hook = runner.speculator.draft.model.register_forward_pre_hook(
            lambda _m, args: seen.append(args[1].detach().clone())
        )
        text, images = CASES[0]
        _, _, mm = llm.llm_engine.process_prompt_mm(_prompt(text, images))
        assert mm is not None
        _run(llm, [CASES[0]])
        hook.remove()
        f = mm.features[0]
        with torch.inference_mode():
            enc = runner.model.embed_multimodal(torch.from_numpy(f.pixel_values), [f.grid_thw])[0]
    finally:
        llm.shutdown()
    rows = torch.cat(seen)
    # Every encoder row was a draft input (rows of other inputs are ~10 away).
    dist = torch.cdist(enc.float(), rows.float(), compute_mode="donot_use_mm_for_euclid_dist")
    assert dist.min(dim=1).values.max() < 1e-4


def test_encoder_outputs_freed_once_the_image_is_computed(vl_dir):
    """An image's encoder output lives until the request has computed its placeholder run in
    full (across chunks), not for the whole decode."""
    llm = LLM(model=vl_dir, enable_chunked_prefill=True, max_num_batched_tokens=8, **COMMON)
    try:
        engine = llm.llm_engine
        mm_state = engine.executor.worker.model_runner.mm
        text, images = CASES[0]
        engine.add_request(
            "r", _prompt(text, images), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        )
        sizes = []
        while engine.has_unfinished_requests():
            engine.step()
            sizes.append(len(mm_state.encoder_cache))
        model = engine.executor.worker.model_runner.model
        assert model.num_encoded_images == 1  # kept across the chunks it spans
    finally:
        llm.shutdown()
    assert 1 in sizes and sizes[-6:] == [0] * 6  # freed before the decode steps


def test_hybrid_prefix_cache_with_images(vl_dir):
    """The hybrid VL model (Gated DeltaNet layers): a prompt with an image seen before resumes
    at its last full block (the linear-attention states there were checkpointed with the
    image's embeddings in them); the same text with another image shares nothing after the
    image's first block and still gets HF's output."""
    text = "some shared text before the image " + PH + " and after it, more text to read"
    a, b = q35.make_test_image(10, (64, 48)), q35.make_test_image(11, (64, 48))
    refs = [q35.hf_vl_greedy(vl_dir, text, [im], GREEDY.max_tokens) for im in (a, b)]
    llm = LLM(model=vl_dir, **COMMON)
    try:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
        _, ids, _ = llm.llm_engine.process_prompt_mm(_prompt(text, [a]))
        got, cached = [], []
        for im in (a, a, b):
            out = llm.generate(_prompt(text, [im]), GREEDY, use_tqdm=False)[0]
            got.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens)
    finally:
        llm.shutdown()
    assert got == [refs[0], refs[0], refs[1]]
    block = COMMON["block_size"]
    assert cached[:2] == [0, (len(ids) - 1) // block * block]
